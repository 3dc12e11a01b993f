"""Every `tandem` command in the README's shell blocks parses as written and its config loads (so the
README cannot drift from the CLI again); the cheap ones run for real."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tandem.cli import main, parse_args
from tandem.config import load_config

REPO = Path(__file__).resolve().parents[2]
# placeholders the README uses, and what stands in for them here
PLACEHOLDERS = {"CONFIG": "configs/grpo_tiny.yaml", "HOST": "127.0.0.1"}
METHOD_COMMANDS = {"grpo", "sft", "rm", "dpo", "ppo"}


def readme_commands(*, placeholders: bool = True) -> list[tuple[int, list[str]]]:
    """(line number, argv after `tandem`) for each tandem command in a ```bash block: direct,
    through .venv/bin/tandem, or `-m tandem.cli` / `--module tandem.cli` under a launcher.
    placeholders=False: only the commands that name everything themselves (no CONFIG, no HOST)."""
    text = (REPO / "README.md").read_text()
    found = []
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        first_line = text[: block.start()].count("\n") + 2
        lines = block.group(1).replace("\\\n", " ").split("\n")
        for offset, line in enumerate(lines):
            tokens = shlex.split(line, comments=True)
            for i, token in enumerate(tokens):
                if token in ("tandem", ".venv/bin/tandem") or (
                    token == "tandem.cli" and tokens[i - 1] in ("-m", "--module")
                ):
                    argv = [PLACEHOLDERS.get(t, t) for t in tokens[i + 1 :]]
                    if placeholders or not set(tokens) & PLACEHOLDERS.keys():
                        found.append((first_line + offset, argv))
                    break
    return found


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_we_expect():
    commands = {argv[0] for _, argv in COMMANDS if argv}
    assert {"grpo", "sft", "rm", "dpo", "ppo", "train", "sample", "launch", "eval", "plot"} <= commands
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize("line, argv", COMMANDS, ids=[f"README:{n}" for n, _ in COMMANDS])
def test_a_readme_command_parses_and_its_config_loads(line, argv):
    if argv[:1] == ["--version"]:
        return
    args = parse_args(argv)
    if not hasattr(args, "overrides"):
        return  # eval, plot, keygen, check-comm, doctor: parsed is all there is before running
    method = args.command if args.command in METHOD_COMMANDS else None
    extra = [f"rm.task={args.task}"] if getattr(args, "task", None) else []
    cfg = load_config(args.config, [*args.overrides, *extra], method=method)
    if args.command in ("train", "sample"):
        assert cfg.method in ("grpo", "ppo")


LAYOUTS = [(n, argv) for n, argv in readme_commands(placeholders=False) if argv[:1] == ["launch"]]


@pytest.mark.parametrize("line, argv", LAYOUTS, ids=[f"README:{n}" for n, _ in LAYOUTS])
def test_a_readme_launch_layout_validates_at_its_world_size(line, argv):
    """The GPU layouts the README shows (e.g. the seeds' sampler on GPU 0 and two trainer ranks)
    pass the batch check at the world size they launch: training devices x nodes."""
    from tandem.config import validate_batch

    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    devices = [d for d in (args.training_devices or "cpu").split(",") if d]
    validate_batch(cfg, world_size=len(devices) * args.nnodes)


def test_the_readme_shows_the_seeds_gpu_layout():
    seeds = [
        argv
        for _, argv in LAYOUTS
        if "--sampling-devices" in argv and argv[argv.index("--training-devices") + 1] == "1,2"
    ]
    assert seeds and any("--dry-run" in argv for argv in seeds)


def test_the_cheap_readme_commands_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and "tandem" in capsys.readouterr().out
    assert main(["config", "show", "configs/grpo_tiny.yaml", "training.max_steps=5"]) == 0
    shown = capsys.readouterr().out
    assert "max_steps: 5" in shown and "experiment_name: grpo_tiny" in shown
    assert main(["doctor"]) == 0
    assert "torch" in capsys.readouterr().out
    assert main(["keygen", str(tmp_path / "keys")]) == 0
    assert (tmp_path / "keys" / "trainer.key_secret").is_file()
