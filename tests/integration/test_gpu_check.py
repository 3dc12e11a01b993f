"""`make gpu-check` (benchmarks/gpu_check.py): without CUDA it stops at once, saying so; its own
plumbing (runs, figures, results file, table) is checked here on the CPU with a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check would run")
def test_without_cuda_it_exits_at_once_saying_so(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and "sees no GPU" in proc.stderr
    assert not out.exists()


def test_the_plan_names_every_gpu_path():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60)
    names = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    assert {"gpu-tests", "colocated-bf16", "colocated-fp16", "decoupled-bf16", "eval-sampled"} <= names
    assert {f"{s}-{b}" for s in ("ddp", "zero2", "zero3") for b in ("nccl", "gloo")} <= names


@pytest.mark.slow
def test_a_cpu_self_check_runs_records_and_tabulates(tiny_model_dir, tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--only", "colocated-bf16"]
        + ["--model", str(tiny_model_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["passed"] and "proves nothing about GPUs" in results["facts"]["note"]
    run = results["checks"]["colocated-bf16"]
    assert run["steps"] == 3 and run["loss_finite"] and run["step_seconds"] > 0
    assert run["generate_tokens_per_second"] > 0 and run["ratio_abs_dev_first_step"] is not None
    assert run["evaluated_initial"]  # the held-out evaluation (eval.*) ran on the device
    assert "colocated-bf16   pass" in proc.stdout


def test_zero3_checks_are_fed_by_a_sampler():
    """A ZeRO-3 trainer cannot generate (its policy is sharded): those checks must go through
    `tandem launch`, a sampler beside the trainer, or they would fail on the GPU machine."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    checks = {c.name: c for c in module.plan("cuda", None)}
    for name in ("zero3-nccl", "zero3-gloo"):
        argv = checks[name].argv
        assert argv[0] == "launch" and "training.zero_stage=3" in argv
        assert argv[argv.index("--training-devices") + 1] == "0"
