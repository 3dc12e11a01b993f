"""Atomic checkpoints: checkpoints/step-N/ appears only once every file in it is written and synced.

A checkpoint holds the model (safetensors, HF layout), optimizer, scheduler, RNG states and the
trainer state (step, policy version, data position), enough for a bit-exact resume on the CPU.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch

from tandem.atomic import atomic_dir

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def save_checkpoint(
    checkpoints_dir: Path,
    step: int,
    *,
    model,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trainer_state: dict,
    generator: torch.Generator | None = None,
    tokenizer=None,
) -> Path:
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        rng = {"torch": torch.get_rng_state()}
        if generator is not None:
            rng["generator"] = generator.get_state()
        torch.save(rng, tmp / "rng.pt")
        state = {**trainer_state, "step": step, "python_rng": python_rng_state()}
        (tmp / STATE_FILE).write_text(json.dumps(state))

    return atomic_dir(checkpoints_dir / f"step-{step}", write)


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first (temporary folders of an interrupted save are ignored)."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(spec: str | None, checkpoints_dir: Path) -> Path | None:
    """`latest` -> newest complete checkpoint (None when there is none yet), a path -> that path."""
    if spec is None:
        return None
    if spec == "latest":
        found = list_checkpoints(checkpoints_dir)
        return found[-1][1] if found else None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"training.resume_from_checkpoint={spec}: no {STATE_FILE} there; "
            "give a checkpoints/step-N folder or `latest`"
        )
    return path


def load_checkpoint(
    path: Path, *, model, optimizer, scheduler, generator: torch.Generator | None = None
) -> dict:
    """Restore everything save_checkpoint wrote; returns the trainer state dict."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # tied weights are saved once; anything else missing is a real mismatch
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if generator is not None and "generator" in rng:
        generator.set_state(rng["generator"])
    state = json.loads((path / STATE_FILE).read_text())
    set_python_rng_state(state.pop("python_rng"))
    return state


def prune_checkpoints(checkpoints_dir: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (0 = keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(checkpoints_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
