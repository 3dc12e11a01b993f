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
    proc = _writer_in_a_child(tmp_path, "step-4")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-4")], (
        "the kill left a temp folder"
    )
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert ckpt.resolve_resume("latest", tmp_path).name == "step-2"


def _writer_in_a_child(folder, name):
    """A process that starts an atomic save of folder/name and stays inside it until killed."""
    script = textwrap.dedent(f"""
        import time
        from tandem.trainer import checkpoint as ckpt
        def slow_write(tmp):
            (tmp / "model").mkdir()
            (tmp / "model" / "half.safetensors").write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
        ckpt.atomic_dir(ckpt.Path({str(folder)!r}) / {name!r}, slow_write)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_leftovers_of_killed_saves_are_removed_and_live_ones_kept(tmp_path):
    """remove_leftovers (called when a run starts) removes the `.tmp-*` folder of a save whose writer
    was killed, keeps one whose writer still runs, and leaves everything else alone."""
    from tandem.atomic import remove_leftovers

    _save(tmp_path, 2, _Model())
    killed = _writer_in_a_child(tmp_path, "step-4")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    live = _writer_in_a_child(tmp_path, "step-6")
    try:
        (tmp_path / ".tmp-notes").write_text("a file, not a save folder")
        removed = remove_leftovers(tmp_path)
        assert [p.name.rsplit("-", 1)[0] for p in removed] == [".tmp-step-4"]
        names = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir())
        assert names == [".tmp", ".tmp-step-6", "step"]  # the live save and the complete step-2
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    finally:
        live.kill()
        live.wait()
    assert [p.name.rsplit("-", 1)[0] for p in remove_leftovers(tmp_path)] == [".tmp-step-6"]
    assert not (tmp_path / "step-2" / ".writer").exists()  # the marker never reaches a finished save


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


def _record(run, *, steps=()):
    """A run folder as a run leaves it: metrics, samples, and complete checkpoints at `steps`."""
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in steps:
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / ckpt.STATE_FILE).write_text("{}")


@pytest.mark.parametrize("resume", [None, "latest"])
def test_a_record_without_checkpoints_is_moved_aside_not_deleted(tmp_path, resume):
    run = tmp_path / "grpo_tiny"
    _record(run)
    (run / "checkpoints" / ".tmp-step-10-x").mkdir(parents=True)  # a save killed midway
    assert ckpt.prepare_run_dir(run, resume) is None
    assert list(run.iterdir()) == []
    (aside,) = tmp_path.glob("grpo_tiny.previous-*")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # a second aborted start on the same second gets its own folder
    _record(run)
    ckpt.prepare_run_dir(run, resume)
    assert len(list(tmp_path.glob("grpo_tiny.previous-*"))) == 2


def test_checkpoints_are_resumed_with_latest_and_refused_without(tmp_path):
    run = tmp_path / "run"
    _record(run, steps=(10, 20))
    assert ckpt.prepare_run_dir(run, "latest") == run / "checkpoints" / "step-20"
    with pytest.raises(ckpt.RunFolderTaken) as err:
        ckpt.prepare_run_dir(run, None)
    # both fixes change the outcome: continue it, or a new name
    assert "step-20" in str(err.value)
    assert "training.resume_from_checkpoint=latest" in str(err.value) and "experiment_name=" in str(err.value)
    assert (run / "metrics.jsonl").exists()


def test_a_folder_holding_only_sampler_logs_is_not_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "sampler-s0.log").write_text("started\n")
    assert ckpt.prepare_run_dir(run, "latest") is None
    assert (run / "logs" / "sampler-s0.log").exists()
    assert ckpt.prepare_run_dir(tmp_path / "absent", None) is None


def test_a_trainer_leaves_its_running_samplers_files_in_place(tmp_path):
    """The launcher starts the samplers beside the trainer: by the time the trainer settles the
    folder they may be writing logs/ and samplers/. Only the old trainer record moves aside."""
    run = tmp_path / "run"
    _record(run)
    (run / "samplers").mkdir()
    (run / "samplers" / "s0.jsonl").write_text("{}\n")
    (run / "logs").mkdir()
    assert ckpt.prepare_run_dir(run, "latest", samplers_running=True) is None
    (aside,) = tmp_path.glob("run.previous-*")
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "samples"]
    assert sorted(p.name for p in run.iterdir()) == ["logs", "samplers"]
    # nothing of the trainer's left: a second start finds nothing to move
    assert ckpt.prepare_run_dir(run, "latest", samplers_running=True) is None
    assert len(list(tmp_path.glob("run.previous-*"))) == 1
