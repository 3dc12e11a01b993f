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
    assert {"variants-colocated", "agent-colocated", "agent-decoupled"} <= names


@pytest.mark.slow
def test_a_cpu_self_check_runs_records_and_tabulates(tiny_model_dir, tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--only", "colocated-bf16,agent-colocated"]
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
    agent = results["checks"]["agent-colocated"]  # agent episodes (a calculator tool) on the device
    assert agent["steps"] == 3 and agent["loss_finite"]


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


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_pytest_counts_and_skip_reasons_come_from_the_summary():
    log = (
        ".............s....\n"
        "SKIPPED [1] tests/unit/test_x.py:315: could not import 'flash_attn'\n"
        "17 passed, 1 skipped, 32 deselected in 19.85s\n"
    )
    counts = load_script().pytest_counts(log)
    assert counts["tests_passed"] == 17 and counts["tests_skipped"] == 1
    assert counts["skipped_because"] == ["tests/unit/test_x.py:315: could not import 'flash_attn'"]
    assert load_script().pytest_counts("=== 2 failed, 3 passed in 1.0s ===") == {
        "tests_failed": 2,
        "tests_passed": 3,
    }


def test_partial_records_of_one_machine_merge_into_one(tmp_path):
    def record(name, checks, passed=True, device="NVIDIA H200"):
        path = tmp_path / name
        body = {"facts": {"device_name": device}, "when": "t", "seconds": 1.0, "jobs": 1, "model": "m"}
        path.write_text(json.dumps({**body, "checks": checks, "not_run": [], "passed": passed}))
        return str(path)

    module = load_script()
    a = record("a.json", {"gpu-tests": {"passed": True}})
    b = record("b.json", {"ddp-nccl": {"passed": False}}, passed=False)
    merged = module.merge([a, b])
    assert set(merged["checks"]) == {"gpu-tests", "ddp-nccl"} and not merged["passed"]
    assert [i["checks"] for i in merged["invocations"]] == [["gpu-tests"], ["ddp-nccl"]]
    with pytest.raises(SystemExit, match="different devices"):
        module.merge([a, record("c.json", {"x": {"passed": True}}, device="NVIDIA H100")])
    with pytest.raises(SystemExit, match="more than one record"):
        module.merge([a, a])
