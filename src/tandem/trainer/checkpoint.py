"""Atomic checkpoints: checkpoints/step-N/ appears only once every file in it is written and synced.

A checkpoint holds the model (safetensors, HF layout), optimizer, scheduler, RNG states and the
trainer state (step, policy version, data position), enough for a bit-exact resume on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.atomic import atomic_dir, commit_dir, temporary_dir  # noqa: F401 - atomic_dir re-exported
from tandem.distributed.env import DistEnv, barrier, broadcast_json

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"

log = logging.getLogger(__name__)


class NonFiniteWeights(RuntimeError):
    """A tensor about to be saved holds NaN or inf; nothing was written."""


def require_finite(module: torch.nn.Module, what: str) -> None:
    """Refuse to save a model with a NaN or inf anywhere (every rank checks, so all stop together;
    the engine's skipped steps keep this from happening, this is the last line)."""
    for name, tensor in module.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteWeights(f"{what}: {name} holds NaN or inf values; refusing to write it")


def python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def save_checkpoint(
    checkpoints_dir: Path,
    step: int,
    *,
    engine,
    env: DistEnv,
    trainer_state: dict,
    generator: torch.Generator | None = None,
    tokenizer=None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Every rank calls this. The engine writes its state in its own format (optimizer.pt and
    scheduler.pt, or DeepSpeed's shards under deepspeed/), rank 0 writes the full model as an HF
    folder (gathered under ZeRO-3) and whatever `write_extra(folder)` adds (PPO's value head),
    each rank its RNG states; rank 0 renames the folder into place only after every rank has
    finished writing."""
    final = checkpoints_dir / f"step-{step}"
    tmp = Path(broadcast_json(env, str(temporary_dir(final)) if env.is_main else None))
    try:
        engine.save(tmp)
        with engine.gathered():
            require_finite(engine.module, f"checkpoint step-{step}")
            if env.is_main:
                engine.module.save_pretrained(tmp / "model", safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp / "model")
                if write_extra is not None:
                    write_extra(tmp)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout and the like on the GPU
            rng["cuda"] = torch.cuda.get_rng_state()
        if generator is not None:
            rng["generator"] = generator.get_state()
        torch.save(rng, tmp / f"rng-{env.rank}.pt")
        barrier(env)
        if env.is_main:
            state = {
                **trainer_state,
                "step": step,
                "world_size": env.world_size,
                "format": engine.format,
                "python_rng": python_rng_state(),
            }
            (tmp / STATE_FILE).write_text(json.dumps(state))
            commit_dir(tmp, final)
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(env)
    return final


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


# what the trainer leaves in a run folder (README: "What a run leaves behind"); logs/ and samplers/
# are the samplers' (a launcher makes logs/ before the trainer starts, samplers write samplers/)
RECORD_NAMES = (
    "metrics.jsonl",
    "config.yaml",
    "train.log",
    "checkpoints",
    "final",
    "samples",
    "plots",
    "tensorboard",
    "sync_state.json",
    "weights",
)
SAMPLER_NAMES = ("logs", "samplers")


class RunFolderTaken(FileExistsError):
    """The run folder holds checkpoints and the config did not ask to resume them."""


def prepare_run_dir(run_dir: Path, resume: str | None, *, samplers_running: bool = False) -> Path | None:
    """Decide what a run folder becomes at start-up (the launcher, or rank 0 of a trainer, before
    anything loads); returns the checkpoint to resume, or None for a fresh start.

    - `resume` a path: that checkpoint. `latest` with a complete checkpoint: the newest one.
    - checkpoints present but `resume` unset: refused, naming the two fixes (continue or rename).
    - a record without any checkpoint to resume (an aborted start, or `latest` on a folder that
      never reached its first save): nothing in it can be continued, so it is moved aside to
      RUN.previous-<time>/ (nothing is deleted) and the run starts fresh. With `samplers_running`
      (a trainer whose samplers may already write logs/ and samplers/) those two stay in place.
    """
    if resume is not None and resume != "latest":
        return resolve_resume(resume, run_dir / "checkpoints")
    found = list_checkpoints(run_dir / "checkpoints")
    if found and resume == "latest":
        return found[-1][1]
    if found:
        newest = found[-1][1]
        raise RunFolderTaken(
            f"{run_dir} already holds a run with checkpoints up to {newest.name}: continue it with "
            f"training.resume_from_checkpoint=latest, or start a new run with experiment_name=<new name>"
        )
    if any((run_dir / name).exists() for name in RECORD_NAMES):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, n = run_dir.with_name(f"{run_dir.name}.previous-{stamp}"), 1
        while aside.exists():
            n += 1
            aside = run_dir.with_name(f"{run_dir.name}.previous-{stamp}-{n}")
        aside.mkdir()
        keep = SAMPLER_NAMES if samplers_running else ()
        for entry in sorted(run_dir.iterdir()):
            if entry.name not in keep:
                os.replace(entry, aside / entry.name)
        log.warning(
            "%s held a run with no checkpoint to resume (an interrupted start?); moved it to %s and "
            "starting afresh",
            run_dir,
            aside,
        )
    return None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was written at."""
    return int(json.loads((path / STATE_FILE).read_text())["step"])


def load_model_weights(folder: Path, model) -> None:
    """The safetensors of an HF folder into `model` (tied weights are saved once); a LoRA policy's
    checkpoint holds its adapters only (the base is model.policy itself)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise RuntimeError(
                f"checkpoint {folder} does not match the adapters: {result.unexpected_keys[:5]}"
            )
        return

    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {folder} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_checkpoint(
    path: Path,
    *,
    engine,
    env: DistEnv,
    generator: torch.Generator | None = None,
    load_extra: Callable[[Path], None] | None = None,
) -> dict:
    """Restore everything save_checkpoint wrote (every rank calls this); returns the trainer state.
    `load_extra(path)` reads what a loop's `write_extra` wrote beside the model (PPO's value head)
    where the engine's own checkpoint does not hold it already (PyTorch format).

    A PyTorch-format checkpoint resumes under `none` or `ddp` at any world size; a DeepSpeed one
    under DeepSpeed (its own rules on changing the world size apply). A rank without its own RNG
    file (more ranks than when saved) continues from rank 0's."""
    state = json.loads((path / STATE_FILE).read_text())
    if engine.format == "torch":
        load_model_weights(path / "model", engine.module)
        if load_extra is not None:
            load_extra(path)
    engine.load(path)
    engine.skips.steps_done = int(state["step"])
    rng_file = path / f"rng-{env.rank}.pt"
    if not rng_file.is_file():
        rng_file = path / "rng-0.pt"
    rng = torch.load(rng_file, map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():  # this rank's current device (set at start-up)
        torch.cuda.set_rng_state(rng["cuda"])
    if generator is not None and "generator" in rng:
        generator.set_state(rng["generator"])
    set_python_rng_state(state.pop("python_rng"))
    return state


def prune_checkpoints(checkpoints_dir: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints (0 = keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(checkpoints_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
