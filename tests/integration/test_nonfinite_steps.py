"""A non-finite loss or gradient never reaches the weights (issue: hostile peers and crashes).

Every strategy skips the step the way loss scalers do: a run whose step 1 holds one completion with
an infinite advantage ends with exactly the parameters of a run that never saw step 1 (no optimizer
or schedule step, no Adam moments touched), on one rank and on two ranks under DDP, ZeRO-2 and
ZeRO-3 (real torchrun processes, gloo). A run that keeps producing non-finite steps stops with an
error naming the step and leaves no NaN on disk."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from integration.test_distributed import ROOT, child_env, run_driver

pytestmark = pytest.mark.slow
BATCH = ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def left_out(tiny_model_dir, tmp_path_factory):
    """One process, steps 0 and 2 only."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LEAVE_OUT_STEP", "1")
    try:
        return run_driver(
            tmp_path_factory.mktemp("left_out"),
            tiny_model_dir,
            "left_out",
            1,
            "training.distributed_strategy=none",
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=4",
        )
    finally:
        mp.undo()


@pytest.mark.parametrize(
    ("nproc", "strategy"),
    [
        (
            1,
            [
                "training.distributed_strategy=none",
                "training.micro_batch_size=4",
                "training.gradient_accumulation_steps=4",
            ],
        ),
        (2, ["training.distributed_strategy=ddp", *BATCH]),
        (2, ["training.distributed_strategy=deepspeed", "training.zero_stage=2", *BATCH]),
        (2, ["training.distributed_strategy=deepspeed", "training.zero_stage=3", *BATCH]),
    ],
    ids=["none", "ddp", "zero2", "zero3"],
)
def test_a_non_finite_step_is_skipped_as_if_it_never_came(
    left_out, tiny_model_dir, tmp_path, monkeypatch, nproc, strategy
):
    if "deepspeed" in strategy[0]:
        pytest.importorskip("deepspeed")
    monkeypatch.setenv("POISON_STEP", "1")
    params, record = run_driver(tmp_path, tiny_model_dir, "poisoned", nproc, *strategy)
    want_params, want = left_out
    skipped = [row["skipped_nonfinite"] for row in record["rows"]]
    assert skipped == [False, True, False]
    assert not math.isfinite(record["rows"][1]["grad_norm"])
    # the lr schedule did not move either: the third step runs at the second step's rate
    assert record["rows"][2]["lr"] == want["rows"][1]["lr"]
    for name, value in want_params.items():
        assert torch.isfinite(params[name]).all(), name
        if nproc == 1:  # the same process, the same arithmetic: bit for bit
            assert torch.equal(params[name], value), name
        else:  # as test_distributed's world-size invariance: fp32 summation order only
            torch.testing.assert_close(params[name], value, rtol=0, atol=2e-6, msg=name)


def test_a_diverged_run_stops_naming_the_step_and_saves_no_nan(tiny_model_dir, tmp_path):
    """SFT at a learning rate of 1e30: the first update makes the weights huge, every later loss is
    non-finite; after training.max_nonfinite_steps skips the run stops, exit code 1, the message
    names the step, every checkpoint on disk is finite and no final/ is written."""
    run = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem",
            "sft",
            f"model.policy={tiny_model_dir}",
            "data.num_examples=64",
            "data.num_eval_examples=4",
            "data.num_shots=0",
            f"output_dir={run}",
            "experiment_name=diverge",
            "training.device=cpu",
            "training.learning_rate=1e30",
            "training.max_grad_norm=0",
            "training.max_steps=12",
            "training.save_steps=1",
            "training.micro_batch_size=4",
            "training.max_nonfinite_steps=3",
        ],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "optimizer steps in a row had a non-finite loss or gradient" in proc.stderr, proc.stderr[-3000:]
    assert "training.max_nonfinite_steps" in proc.stderr
    rows = [json.loads(line) for line in (run / "diverge" / "metrics.jsonl").read_text().splitlines()]
    skipped = [row["step"] for row in rows if row["skipped_nonfinite"]]
    assert skipped and len(skipped) <= 3 and f"step {skipped[-1] + 1}:" in proc.stderr
    assert not (run / "diverge" / "final").exists()
    saved = sorted((run / "diverge" / "checkpoints").glob("step-*"))
    assert saved
    for folder in saved:
        for name, tensor in load_file(str(folder / "model" / "model.safetensors")).items():
            assert torch.isfinite(tensor).all(), f"{folder.name}: {name}"
