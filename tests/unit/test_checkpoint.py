"""Checkpoints appear whole or not at all; an interrupted save leaves the previous one usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.config import TrainingConfig
from tandem.distributed.engine import TorchEngine
from tandem.distributed.env import DistEnv
from tandem.trainer import checkpoint as ckpt


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def save_pretrained(self, folder, safe_serialization=True):
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file(self.state_dict(), os.path.join(folder, "model.safetensors"))


def _save(tmp_path, step, model):
    engine = TorchEngine(model, TrainingConfig(), DistEnv(), torch.device("cpu"))
    return ckpt.save_checkpoint(
        tmp_path,
        step,
        engine=engine,
        env=DistEnv(),
        trainer_state={"data": {"epoch": 0, "index": step}},
    )


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model = _Model()
    _save(tmp_path, 2, model)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 4, model)
    monkeypatch.undo()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")], "temporary folder left behind"
    assert ckpt.resolve_resume("latest", tmp_path).name == "step-2"


def test_killed_save_is_ignored_by_resume(tmp_path):
    """SIGKILL in the middle of writing: the half-written folder is never picked up."""
    _save(tmp_path, 2, _Model())
    script = textwrap.dedent(f"""
        import time, torch
        from tandem.trainer import checkpoint as ckpt
        def slow_write(tmp):
            (tmp / "model").mkdir()
            (tmp / "model" / "half.safetensors").write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
        ckpt.atomic_dir(ckpt.Path({str(tmp_path)!r}) / "step-4", slow_write)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-4")], (
        "the kill left a temp folder"
    )
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert ckpt.resolve_resume("latest", tmp_path).name == "step-2"


def test_prune_keeps_newest(tmp_path):
    model = _Model()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model)
    ckpt.prune_checkpoints(tmp_path, 2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]


def test_resume_from_a_wrong_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoints/step-N"):
        ckpt.resolve_resume(str(tmp_path / "nope"), tmp_path)
    assert ckpt.resolve_resume("latest", tmp_path / "empty") is None
