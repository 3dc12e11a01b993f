"""The command line: bad configs exit 2 with a message that names the key and the fix."""

from __future__ import annotations

import pytest

from tandem.cli import build_parser, main


def test_unknown_key_names_the_closest(capsys):
    assert main(["grpo", "configs/grpo_tiny.yaml", "training.learnig_rate=1e-5"]) == 2
    err = capsys.readouterr().err
    assert "training.learnig_rate" in err and "training.learning_rate" in err


def test_bad_value_names_the_key(capsys):
    assert main(["grpo", "configs/grpo_tiny.yaml", "grpo.loss_agg=sum"]) == 2
    assert "grpo.loss_agg" in capsys.readouterr().err


def test_missing_config_file(capsys, tmp_path):
    assert main(["grpo", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["grpo", "eval", "plot", "doctor"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert command in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["rm", "configs/rm_harmless.yaml", "--task", "harmless", "training.max_steps=4"],
        ["rm", "--task", "harmless", "training.max_steps=4", "configs/rm_harmless.yaml"],
        ["rm", "training.max_steps=4", "configs/rm_harmless.yaml", "--task", "harmless"],
    ],
)
def test_overrides_and_options_in_any_order(argv):
    from tandem.cli import parse_args

    args = parse_args(argv)
    assert (args.config, args.overrides, args.task) == (
        "configs/rm_harmless.yaml",
        ["training.max_steps=4"],
        "harmless",
    )


def test_the_readme_sampler_line_takes_overrides_after_its_options():
    """README: `tandem sample CONFIG --trainer-host HOST pipeline.curve.server_public_key=...`."""
    from tandem.cli import parse_args

    args = parse_args(
        ["sample", "c.yaml", "--trainer-host", "h1", "pipeline.curve.server_public_key=k", "seed=2"]
    )
    assert (args.config, args.trainer_host, args.overrides) == (
        "c.yaml",
        "h1",
        ["pipeline.curve.server_public_key=k", "seed=2"],
    )


def test_a_stray_option_or_a_second_file_is_refused(capsys):
    from tandem.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["grpo", "configs/grpo_tiny.yaml", "--no-such-flag"])
    assert "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["grpo", "configs/grpo_tiny.yaml", "configs/sft_tiny.yaml"])
    assert "key=value" in capsys.readouterr().err


def test_train_takes_the_seeds_worker_flags():
    from tandem.cli import _port_overrides, parse_args

    args = parse_args(
        ["train", "configs/grpo_tiny.yaml", "--gpu-id", "1", "--data-port", "6000", "--sync-port", "6001"]
    )
    assert (args.gpu_id, args.data_port, args.sync_port) == (1, 6000, 6001)
    assert _port_overrides(args) == ["pipeline.data_port=6000", "pipeline.sync_port=6001"]


@pytest.mark.parametrize("command", ["train", "sample"])
def test_train_and_sample_refuse_a_config_of_another_method_before_loading(command, capsys):
    assert main([command, "configs/sft_tiny.yaml"]) == 2
    assert "tandem sft" in capsys.readouterr().err


def test_a_grpo_config_is_refused_by_sft(capsys):
    assert main(["sft", "configs/grpo_tiny.yaml"]) == 2
    assert "run it with `tandem grpo`" in capsys.readouterr().err


def test_version_and_python_m_tandem():
    import subprocess
    import sys

    import tandem

    out = subprocess.run(
        [sys.executable, "-m", "tandem", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"tandem {tandem.__version__}"
    from importlib.metadata import version

    assert version("tandem") == tandem.__version__  # one source: pyproject reads it from the package


def test_config_show_prints_the_resolved_config_without_loading(capsys):
    import subprocess
    import sys

    import yaml

    assert main(["config", "show", "configs/sft_tiny.yaml", "training.per_device_train_batch_size=2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["method"] == "sft" and shown["training"]["micro_batch_size"] == 2
    assert main(["config", "show", "configs/sft_tiny.yaml", "--method", "dpo"]) == 2
    # nothing heavy is imported: no model library, no torch
    code = (
        "import sys, contextlib, io; from tandem.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['config', 'show', 'configs/grpo_tiny.yaml'])\n"
        "print(sorted(m for m in ('torch', 'transformers', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
