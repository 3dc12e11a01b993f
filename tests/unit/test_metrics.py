"""Tests for tandem.trainer.metrics: the metrics.jsonl record, sample dumps, TensorBoard mirroring."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.trainer.metrics import (
    REQUIRED_FIELDS,
    MetricsLogger,
    read_metrics,
    to_json_safe,
    trl_aliases,
    write_samples,
)


def make_row(step: int, **extra) -> dict:
    row = {k: 0.5 for k in REQUIRED_FIELDS}
    row.update(step=step, policy_version=step, tokens_generated=100 * step, groups_dropped_stale=0)
    row.update(extra)
    return row


def test_required_fields_match_design():
    assert REQUIRED_FIELDS[0] == "step"
    assert len(REQUIRED_FIELDS) == len(set(REQUIRED_FIELDS)) == 16


def test_logger_writes_one_valid_json_object_per_row(tmp_path: Path):
    with MetricsLogger(tmp_path, []) as logger:
        logger.log(make_row(1, loss=torch.tensor(0.25), kl=np.float32(0.125), extra_field="note"))
        logger.log(make_row(2, grad_norm=np.float64(3.0)))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 0.25 and type(rows[0]["loss"]) is float
    assert rows[0]["kl"] == 0.125
    assert rows[0]["extra_field"] == "note"
    assert rows[1]["grad_norm"] == 3.0
    assert set(REQUIRED_FIELDS) <= set(rows[1])


def test_row_is_flushed_before_close(tmp_path: Path):
    logger = MetricsLogger(tmp_path, [])
    logger.log(make_row(1))
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 1
    logger.close()


def test_missing_field_raises_key_error_naming_it(tmp_path: Path):
    row = make_row(1)
    del row["kl"], row["lr"]
    with MetricsLogger(tmp_path, []) as logger, pytest.raises(KeyError, match="kl.*lr"):
        logger.log(row)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_non_finite_values_are_written_as_null(tmp_path: Path):
    with MetricsLogger(tmp_path, []) as logger:
        logger.log(
            make_row(1, loss=float("nan"), kl=torch.tensor(float("inf")), grad_norm=np.float32("-inf"))
        )
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["loss"] is None and row["kl"] is None and row["grad_norm"] is None


def test_unknown_report_to_is_a_value_error(tmp_path: Path):
    with pytest.raises(ValueError, match="tensorbord"):
        MetricsLogger(tmp_path, ["tensorbord"])


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path: Path):
    with MetricsLogger(tmp_path, []) as logger:
        for step in range(1, 6):
            logger.log(make_row(step))
    # The run crashed after step 5 but its last checkpoint is step 3: steps 4 and 5 run again.
    with MetricsLogger(tmp_path, [], resume_step=3) as logger:
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        for step in range(4, 7):
            logger.log(make_row(step))
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert not list(tmp_path.glob("*.tmp"))


def test_truncated_last_line_is_skipped(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps(make_row(s)) for s in (1, 2)]
    path.write_text("\n".join(good) + "\n" + good[0][:40])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_corrupt_middle_line_raises(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(make_row(1)) + "\n{oops\n" + json.dumps(make_row(3)) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_reopening_after_a_crash_drops_the_partial_row(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(make_row(1)) + "\n" + json.dumps(make_row(2))[:30])
    with MetricsLogger(tmp_path, []) as logger:
        logger.log(make_row(2))
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_write_samples(tmp_path: Path):
    rows = [
        {
            "prompt": "2+2?",
            "response": "<answer>4</answer>",
            "reward": np.float32(2.25),
            "reward_info": {"answer": 1.0, "format": torch.tensor(1.25)},
            "answer": "4",
            "ids": torch.tensor([1, 2]),
        },
        {"prompt": "ünïcode", "response": "", "reward": float("nan"), "reward_info": {}, "answer": None},
    ]
    path = write_samples(tmp_path, 7, rows)
    assert path == tmp_path / "samples" / "step-000007.jsonl"
    got = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert got[0]["reward"] == 2.25 and got[0]["reward_info"] == {"answer": 1.0, "format": 1.25}
    assert got[0]["ids"] == [1, 2]
    assert got[1]["prompt"] == "ünïcode" and got[1]["reward"] is None


def test_to_json_safe_rejects_unknown_objects():
    assert to_json_safe((1, Path("a"))) == [1, "a"]
    assert to_json_safe(np.array([0.5])) == 0.5  # a one-element array is a scalar
    assert to_json_safe(np.arange(3)) == [0, 1, 2]
    with pytest.raises(TypeError, match="object"):
        to_json_safe(object())


def test_tensorboard_event_file_created(tmp_path: Path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, ["tensorboard"]) as logger:
        logger.log(make_row(1))
        logger.log(make_row(2))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(REQUIRED_FIELDS) - {"step"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2]


def test_trl_names_are_written_to_tensorboard_beside_tandem_names(tmp_path: Path):
    """TRL's GRPOTrainer names reach the TensorBoard event file as aliases; metrics.jsonl keeps
    tandem's names only."""
    pytest.importorskip("tensorboard")
    extra = dict(
        completion_length_mean=7.5,
        clip_ratio_low=0.125,
        clip_ratio_high=0.25,
        entropy=2.0,
        frac_reward_zero_std=0.5,
        finished_fraction=0.75,
        reward_answer=-0.5,
        reward_format=None,  # applied to no completion: no alias
    )
    with MetricsLogger(
        tmp_path, ["tensorboard"], aliases=lambda r: trl_aliases(r, ["answer", "format"])
    ) as log:
        log.log(make_row(1, **extra))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {
        "reward": 0.5,  # reward_mean
        "reward_std": 0.5,
        "completions/mean_length": 7.5,
        "completions/clipped_ratio": 0.25,  # 1 - finished_fraction
        "clip_ratio/low_mean": 0.125,
        "clip_ratio/high_mean": 0.25,
        "clip_ratio/region_mean": 0.5,  # clip_fraction
        "kl": 0.5,
        "entropy": 2.0,
        "frac_reward_zero_std": 0.5,
        "rewards/answer/mean": -0.5,
        "loss": 0.5,
        "learning_rate": 0.5,  # lr
        "grad_norm": 0.5,
    }
    assert set(want) <= tags and "rewards/format/mean" not in tags
    for tag, value in want.items():
        assert acc.Scalars(tag)[0].value == pytest.approx(value) and acc.Scalars(tag)[0].step == 1, tag
    assert {"reward_mean", "lr", "clip_fraction"} <= tags  # tandem's own names too
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert "learning_rate" not in row and "clip_ratio/low_mean" not in row and row["lr"] == 0.5
