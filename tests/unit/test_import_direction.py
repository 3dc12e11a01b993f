"""Imports inside tandem point one way (DESIGN.md, CONTRIBUTING.md's map): a module imports only from its
own unit or from units of a lower tier. Read from the source with `ast`, lazy imports inside functions
included, so a shortcut taken "just inside this function" is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tandem"

# lowest first; a unit is a folder of src/tandem or a top-level module
TIERS: list[tuple[str, ...]] = [
    ("types", "atomic", "runlog", "config"),  # the shared vocabulary, the config tree
    ("algorithms", "data"),  # the pure core; data sets and prompt formats
    ("agent", "tools"),  # tools and environments an episode calls, their calls and results; built-in tools
    ("models", "transport"),  # loading, forwards, LoRA; the wire and the sockets
    ("distributed", "rewards"),  # engines and the process group; reward functions and reward models
    ("sampler",),  # generation and rollouts (the trainer runs one in colocated mode)
    ("trainer",),  # one loop per method, checkpoints, the run record
    ("preflight", "plots", "doctor", "launch"),  # what commands share: checks, plots, process start
    ("evaluate",),  # `tandem eval` (its checks are preflight's)
    ("cli",),
    ("__main__",),
]
# modules that are one unit with another: config_aliases reads the seeds' keys for config.load_config,
# config_convert turns dicts and overrides into config's dataclasses
SAME_UNIT = {"config_aliases": "config", "config_convert": "config", "__init__": "tandem"}
# units of one tier that may import each other, in this direction only
LATERAL = {("distributed", "models"), ("rewards", "models")}


def unit_of(parts: tuple[str, ...]) -> str:
    name = parts[0].removesuffix(".py")
    return SAME_UNIT.get(name, name)


def _is_unit(name: str) -> bool:
    return (SRC / name).is_dir() or (SRC / f"{name}.py").is_file()


def tier_of(unit: str) -> int:
    for i, tier in enumerate(TIERS):
        if unit in tier:
            return i
    raise AssertionError(f"{unit!r} has no tier in TIERS: add it where it belongs")


def imported_units(path: Path) -> set[str]:
    """The tandem units `path` imports (`from tandem.x import y`, `import tandem.x`, `from tandem import x`)."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = node.module.split(".")
            if names[0] == "tandem":
                if len(names) > 1:
                    units.add(unit_of((names[1],)))
                else:  # from tandem import x: a unit, or a name of tandem/__init__.py
                    units.update(unit_of((a.name,)) for a in node.names if _is_unit(a.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "tandem" and len(names) > 1:
                    units.add(unit_of((names[1],)))
    return units


def test_every_unit_has_a_tier():
    units = {unit_of(p.relative_to(SRC).parts) for p in SRC.rglob("*.py")} - {"tandem"}
    for unit in units:
        tier_of(unit)


def test_imports_point_down():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        unit = unit_of(path.relative_to(SRC).parts)
        if unit == "tandem":
            continue
        for target in imported_units(path) - {unit, "tandem"}:
            same = tier_of(target) == tier_of(unit)
            if tier_of(target) > tier_of(unit) or (same and (unit, target) not in LATERAL):
                upward.append(f"{path.relative_to(SRC)} imports tandem.{target}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_the_checker_sees_lazy_and_relative_forms(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from tandem.trainer import grpo\n    import tandem.cli\nfrom tandem import sampler\n"
    )
    assert imported_units(module) == {"trainer", "cli", "sampler"}
