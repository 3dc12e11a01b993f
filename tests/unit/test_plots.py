"""Tests for tandem.plots: PNG figures from a synthetic metrics.jsonl."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tandem.plots import compare_panels, moving_average, plot_run, plot_runs
from tandem.trainer.metrics import REQUIRED_FIELDS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_FIGURES = {"reward.png", "accuracy.png", "kl.png", "completion_length.png", "loss.png", "timing.png"}


def write_run(run_dir: Path, num_steps: int = 20, drop: tuple[str, ...] = (), extra: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, num_steps + 1):
            row = {k: 0.1 for k in REQUIRED_FIELDS}
            acc = 1 - math.exp(-step / 8)
            row.update(
                step=step,
                reward_mean=2 * acc - 1,
                reward_std=0.3,
                answer_accuracy=acc,
                format_accuracy=min(1.0, 2 * acc),
                kl=0.01 * step,
                loss=1 / step,
                grad_norm=None if step == 3 else 2.0,
            )
            if extra:
                row.update(
                    completion_length_mean=100 + step,
                    time_generate=1.0,
                    time_train=0.5,
                    time_other=0.1,
                    step_seconds=1.6,
                )
            for key in drop:
                row.pop(key, None)
            f.write(json.dumps(row) + "\n")
    return run_dir


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5_000, path  # an axis, curves and labels: far more than an empty image


def test_plot_run_writes_every_figure(tmp_path: Path):
    run_dir = write_run(tmp_path / "grpo-demo")
    paths = plot_run(run_dir)
    assert {p.name for p in paths} == ALL_FIGURES
    assert all(p.parent == run_dir / "plots" for p in paths)
    for p in paths:
        assert_png(p)


def test_plot_run_with_smoothing_and_out_dir(tmp_path: Path):
    run_dir = write_run(tmp_path / "run")
    paths = plot_run(run_dir, tmp_path / "figs", smooth=5)
    assert {p.name for p in paths} == ALL_FIGURES
    for p in paths:
        assert p.parent == tmp_path / "figs"
        assert_png(p)


def test_missing_optional_fields_skip_figures(tmp_path: Path):
    run_dir = write_run(tmp_path / "run", extra=False, drop=("kl", "step_seconds"))
    names = {p.name for p in plot_run(run_dir)}
    assert names == {"reward.png", "accuracy.png", "loss.png"}


def test_missing_metrics_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_empty_metrics_file_is_a_clear_error(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no metrics rows"):
        plot_run(tmp_path)


def test_plot_runs_overlays_several_runs(tmp_path: Path):
    a = write_run(tmp_path / "a" / "run", num_steps=15)
    b = write_run(tmp_path / "b" / "run", num_steps=25, drop=("reward_mean",))
    paths = plot_runs([a, b], tmp_path / "compare")
    # reward_mean is in one run only: nothing to compare there
    assert {p.name for p in paths} == {"compare_accuracy.png", "compare_loss.png"}
    for p in paths:
        assert_png(p)
    with pytest.raises(ValueError):
        plot_runs([], tmp_path / "compare")


def test_moving_average_is_trailing_and_ignores_nan():
    values = np.array([1.0, 3.0, np.nan, 5.0, 7.0])
    # windows of 2: [1], [1,3], [3,nan], [nan,5], [5,7]
    np.testing.assert_allclose(moving_average(values, 2), [1.0, 2.0, 3.0, 5.0, 6.0])


def test_supervised_runs_get_their_own_figures(tmp_path):
    """An rm/dpo-style record (eval_* only every few steps) draws loss, eval and accuracy figures;
    GRPO-only figures are skipped."""
    import json

    from tandem.plots import plot_run

    rows = []
    for step in range(1, 7):
        row = {"step": step, "epoch": 0, "loss": 1 / step, "grad_norm": 1.0, "lr": 1e-5, "step_seconds": 1.0}
        row.update(accuracy=0.5 + step / 20, margin_mean=step / 10)
        if step % 3 == 0:
            row.update(eval_loss=1.2 / step, eval_accuracy=0.6, eval_margin_mean=step / 12)
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot_run(tmp_path)}
    assert {"loss.png", "eval_loss.png", "preference_accuracy.png", "margins.png", "timing.png"} <= names
    assert not names & {"reward.png", "kl.png", "value.png", "perplexity.png", "safe_mm.png"}
    assert "cost_sign.png" not in names  # no classification term in these rows

    for row in rows:  # a harmless cost model's rows
        row["classification_accuracy"] = 0.7
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "cost_sign.png" in {p.name for p in plot_run(tmp_path)}


def test_a_safe_mm_dpo_run_gets_the_origins_four_curves(tmp_path):
    """Rows of the lagrangian variant (loss_helpful, loss_harmless, lambda, cost_ema) draw safe_mm.png
    with one panel per curve."""
    from tandem.plots import FIGURES, plot_run

    rows = []
    for step in range(1, 6):
        rows.append(
            {
                "step": step,
                "epoch": 0,
                "loss": 0.6,
                "grad_norm": 1.0,
                "lr": 1e-5,
                "step_seconds": 1.0,
                "loss_helpful": 0.7 - step / 50,
                "loss_harmless": 0.69 - step / 40,
                "lambda": 1.0 + step / 10,
                "cost_ema": 0.5 - step / 5,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "safe_mm.png" in {p.name for p in plot_run(tmp_path)}
    fig = FIGURES["safe_mm.png"]("run", np.arange(1.0, 6.0), rows, 0)
    panels = fig.axes
    assert [ax.get_ylabel() for ax in panels] == [
        "L_H (helpful)",
        "L_S (harmless)",
        "lambda",
        "J_C (smoothed)",
    ]
    np.testing.assert_allclose(panels[2].lines[0].get_ydata(), [r["lambda"] for r in rows])


def _supervised_run(
    run_dir: Path, accuracy_field: str, scale: float, method: str | None = None, **fields: float
) -> Path:
    """A run folder with rows as `tandem rm`/`dpo`/`sft` write them (eval every 3 steps) and, when
    `method` is given, the config.yaml line that names it."""
    rows = []
    for step in range(1, 7):
        row = {
            "step": step,
            "epoch": 0,
            "loss": scale / step,
            "grad_norm": 1.0,
            "lr": 1e-5,
            "step_seconds": 1.0,
            **fields,
        }
        row[accuracy_field] = 0.5 + step / 20
        if step % 3 == 0:
            row["eval_loss"] = 1.2 * scale / step
        rows.append(row)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if method is not None:
        (run_dir / "config.yaml").write_text(f"method: {method}\nexperiment_name: {run_dir.name}\n")
    return run_dir


def test_supervised_runs_of_one_method_are_compared(tmp_path):
    """`tandem plot` of two RM runs: their losses, held-out losses (sparse points) and preference
    accuracies side by side."""
    a = _supervised_run(tmp_path / "a", "accuracy", 1.0, "rm", margin_mean=0.5)
    b = _supervised_run(tmp_path / "b", "accuracy", 0.7, "rm", margin_mean=0.8)
    names = {p.name for p in plot_runs([a, b], tmp_path / "compare")}
    assert names == {
        "compare_loss.png",
        "compare_eval_loss.png",
        "compare_preference_accuracy.png",
        "compare_margin.png",
    }
    for name in names:
        assert_png(tmp_path / "compare" / name)


def test_runs_of_different_methods_share_only_what_means_the_same(tmp_path):
    """Two DPO runs and an RM run: preference accuracy (`reward_accuracy` for dpo, `accuracy` for
    rm) is one figure of all three; losses and margins are compared among the DPO runs only, in
    figures named for the method. A Safe-MM-DPO row's own margin is reward_margin, not the data's
    reward-model margin_mean."""
    dpo_a = _supervised_run(tmp_path / "dpo_a", "reward_accuracy", 1.0, "dpo", reward_margin=0.1)
    dpo_b = _supervised_run(
        tmp_path / "dpo_b", "reward_accuracy", 0.8, "dpo", reward_margin=0.2, margin_mean=3.0
    )
    rm = _supervised_run(tmp_path / "rm", "accuracy", 0.7, "rm", margin_mean=0.5)
    paths = plot_runs([dpo_a, dpo_b, rm], tmp_path / "compare")
    assert {p.name for p in paths} == {
        "compare_preference_accuracy.png",
        "compare_loss-dpo.png",
        "compare_eval_loss-dpo.png",
        "compare_margin-dpo.png",
    }
    for p in paths:
        assert_png(p)
    runs = [dpo_a, dpo_b, rm]
    rows = [[json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    panels = {p[0]: p for p in compare_panels(["a", "b", "rm"], rows, ["dpo", "dpo", "rm"])}
    assert [c[0] for c in panels["compare_margin-dpo.png"][4]] == ["a: reward_margin", "b: reward_margin"]
    assert [c[0] for c in panels["compare_preference_accuracy.png"][4]] == [
        "a: reward_accuracy",
        "b: reward_accuracy",
        "rm: accuracy",
    ]
    assert panels["compare_loss-dpo.png"][1] == "training loss (2 dpo runs)"
    eval_loss = panels["compare_eval_loss-dpo.png"][4][0][2]  # evaluated at steps 3 and 6 only
    assert np.isnan(eval_loss[0]) and eval_loss[2] == pytest.approx(1.2 / 3)


def test_runs_with_nothing_in_common_say_so_and_leave_no_folder(tmp_path):
    """An SFT run and a DPO run both have a `loss`, but not the same loss: nothing to compare, and
    the message says what each recorded."""
    sft = _supervised_run(tmp_path / "sft", "token_accuracy", 1.0, "sft", eval_perplexity=3.0)
    dpo = _supervised_run(tmp_path / "dpo", "reward_accuracy", 1.0, "dpo")
    with pytest.raises(ValueError, match="nothing to compare") as err:
        plot_runs([sft, dpo], tmp_path / "compare")
    assert "sft (sft): loss, eval_loss, eval_perplexity" in str(err.value)
    assert "dpo (dpo): loss, eval_loss, reward_accuracy" in str(err.value)
    assert not (tmp_path / "compare").exists()
    a = tmp_path / "a"
    a.mkdir()
    (a / "metrics.jsonl").write_text(json.dumps({"step": 1, "foo": 1.0}) + "\n")
    with pytest.raises(ValueError, match="a: none"):
        plot_runs([a, _supervised_run(tmp_path / "b", "accuracy", 1.0)], tmp_path / "compare")
    assert not (tmp_path / "compare").exists()


def test_a_decoupled_timing_figure_shows_the_sampler_beside_the_trainer(tmp_path):
    """Decoupled rows (they count dropped messages) get two panels: the trainer's step and the
    sampler's overlapping time for the groups it took."""
    from matplotlib.figure import Figure

    from tandem.plots import _plot_timing

    rows = [
        {
            "step": s,
            "step_seconds": 10.0,
            "time_train": 6.0,
            "time_optimizer": 0.5,
            "wait_seconds": 2.0,
            "time_generate": 8.0,
            "time_reference": 1.0,
            "time_reward": 0.1,
            "messages_dropped": 0,
        }
        for s in range(1, 4)
    ]
    fig = _plot_timing("run", np.arange(1, 4, dtype=float), rows, 0)
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    trainer_labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert trainer_labels == ["train", "optimizer", "wait_seconds", "other", "step_seconds"]
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == ["generate", "reference", "reward"]
    colocated = [{k: v for k, v in r.items() if k != "messages_dropped"} for r in rows]
    fig = _plot_timing("run", np.arange(1, 4, dtype=float), colocated, 0)
    assert len(fig.axes) == 1


def test_held_out_evaluations_are_points_at_their_version(tmp_path):
    from tandem.plots import FIGURES

    rows = [
        {"step": 1, "answer_accuracy": 0.2, "eval_accuracy_initial": 0.1, "eval_policy_version_initial": 0},
        {"step": 2, "answer_accuracy": 0.3},
        {"step": 3, "answer_accuracy": 0.4, "eval_accuracy": 0.5, "eval_policy_version": 2},
    ]
    fig = FIGURES["accuracy.png"]("run", np.array([1.0, 2.0, 3.0]), rows, 0)
    (held_out,) = [line for line in fig.axes[0].lines if "held out" in line.get_label()]
    np.testing.assert_allclose(held_out.get_xdata(), [0.0, 2.0])
    np.testing.assert_allclose(held_out.get_ydata(), [0.1, 0.5])


def test_learning_signal_figures_appear_with_their_fields(tmp_path: Path):
    """entropy, the split clip fractions and dynamic sampling's counts each get a figure once a run
    logs them (GRPO rows since the variants landed); runs without them are unchanged (above)."""
    run_dir = write_run(tmp_path / "signals")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with (run_dir / "metrics.jsonl").open("w") as f:
        for row in rows:
            row.update(
                entropy=2.0 - 0.05 * row["step"],
                clip_ratio_low=0.01,
                clip_ratio_high=0.02,
                groups_filtered=row["step"] % 3,
                generation_overhead=0.1 * (row["step"] % 3),
            )
            f.write(json.dumps(row) + "\n")
    names = {p.name for p in plot_run(run_dir)}
    assert names == ALL_FIGURES | {"entropy.png", "clipping.png", "dynamic_sampling.png"}
    for name in ("entropy.png", "clipping.png", "dynamic_sampling.png"):
        assert_png(run_dir / "plots" / name)
