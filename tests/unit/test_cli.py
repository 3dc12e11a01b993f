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
