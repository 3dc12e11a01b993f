"""PNG curves of a run's metrics.jsonl (`tandem plot RUN_DIR`), and overlays that compare several runs.

Figures are drawn with matplotlib's Agg backend through `matplotlib.figure.Figure`, never pyplot: no
display is needed and the caller's global pyplot backend (e.g. in a notebook) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tandem.trainer.metrics import METRICS_FILE, read_metrics

X_LABEL = "optimizer step"
SAMPLER_PHASES = ("time_generate", "time_reference", "time_reward")  # sampling, scoring the groups
TRAINER_PHASES = ("time_train", "time_optimizer")


def _load_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: is this a run folder (runs/<experiment_name>)?"
        )
    rows = [r for r in read_metrics(path) if r.get("step") is not None]
    if not rows:
        raise FileNotFoundError(f"{path} holds no metrics rows yet: nothing to plot")
    return sorted(rows, key=lambda r: r["step"])


def _series(rows: list[dict], field: str) -> np.ndarray | None:
    """Values of `field` per row (NaN where missing or null); None if no row has a value for it."""
    values = [r.get(field) for r in rows]
    if all(v is None for v in values):
        return None
    return np.array([np.nan if v is None else float(v) for v in values], dtype=float)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` finite values (fewer at the start); NaNs are ignored."""
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _line(ax: Axes, steps: np.ndarray, values: np.ndarray, label: str, smooth: int, **style) -> None:
    """Draw a curve; with smoothing, the raw curve stays faint beneath its moving average."""
    if smooth > 1:
        (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=1, **style)
        ax.plot(steps, moving_average(values, smooth), label=label, color=raw.get_color(), **style)
    else:
        ax.plot(steps, values, label=label, **style)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: no GUI backend is ever consulted
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _new_figure(nrows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(7, 3.2 * nrows + 0.8))
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(X_LABEL)
    return fig, list(axes)


def _plot_reward(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
    mean = _series(rows, "reward_mean")
    if mean is None:
        return None
    fig, (ax,) = _new_figure()
    _line(ax, steps, mean, "reward_mean", smooth)
    std = _series(rows, "reward_std")
    if std is not None:
        ax.fill_between(steps, mean - std, mean + std, alpha=0.15, label="± reward_std")
    ax.set(title=f"{name}: reward", ylabel="reward")
    ax.legend(loc="best")
    return fig


def _plot_accuracy(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
    """The sampled batches' accuracies as curves; held-out evaluations (eval.*) as points at the
    policy version they evaluated (version 0: before training)."""
    curves = {f: _series(rows, f) for f in ("answer_accuracy", "format_accuracy")}
    held_out = {f: _eval_points(rows, f) for f in ("eval_accuracy", "eval_pass_at_k")}
    if all(v is None for v in curves.values()) and not any(held_out.values()):
        return None
    fig, (ax,) = _new_figure()
    for field, values in curves.items():
        if values is not None:
            _line(ax, steps, values, field, smooth)
    for field, points in held_out.items():
        if points:
            versions, values = zip(*points)
            ax.plot(versions, values, marker="o", linestyle="--", label=f"{field} (held out)")
    ax.set(title=f"{name}: accuracy", ylabel="accuracy", ylim=(-0.02, 1.02))
    ax.legend(loc="best")
    return fig


def _plot_safe_mm(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
    """Safe-MM-DPO (lagrangian): the origin's four curves, L_H, L_S, lambda and J_C, one panel each."""
    panels = [
        ("loss_helpful", "L_H (helpful)"),
        ("loss_harmless", "L_S (harmless)"),
        ("lambda", "lambda"),
        ("cost_ema", "J_C (smoothed)"),
    ]
    series = [(field, label, _series(rows, field)) for field, label in panels]
    if series[2][2] is None:
        return None
    fig, axes = _new_figure(len(panels))
    for ax, (field, label, values) in zip(axes, series):
        if values is not None:
            _line(ax, steps, values, field, smooth)
        ax.set(ylabel=label)
    axes[3].axhline(0.0, color="grey", linewidth=0.8)  # lambda rises above this line, falls below
    axes[0].set_title(f"{name}: Safe-MM-DPO losses, multiplier and cost")
    return fig


def _eval_points(rows: list[dict], field: str) -> list[tuple[float, float]]:
    """(policy version, value) of each held-out evaluation in the rows: `field` with its
    eval_policy_version, and `field`_initial at version 0."""
    points = []
    for row in rows:
        for suffix in ("_initial", ""):
            value, version = row.get(field + suffix), row.get("eval_policy_version" + suffix)
            if value is not None and version is not None:
                points.append((float(version), float(value)))
    return sorted(points)


def _single(
    field: str, title: str, ylabel: str
) -> Callable[[str, np.ndarray, list[dict], int], Figure | None]:
    def plot(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
        values = _series(rows, field)
        if values is None:
            return None
        fig, (ax,) = _new_figure()
        _line(ax, steps, values, field, smooth)
        ax.set(title=f"{name}: {title}", ylabel=ylabel)
        return fig

    return plot


def _plot_loss(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
    present = {f: v for f in ("loss", "grad_norm") if (v := _series(rows, f)) is not None}
    if not present:
        return None
    fig, axes = _new_figure(len(present))
    for ax, (field, values) in zip(axes, present.items()):
        _line(ax, steps, values, field, smooth)
        ax.set(ylabel=field)
    axes[0].set_title(f"{name}: {' and '.join(present)}")
    return fig


def _plot_timing(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
    """Where a step's time goes, every phase stacked up to step_seconds ("other": the rest, e.g.
    logging, saving, weight sync). Colocated, sampling is part of the step. Decoupled (rows that
    count dropped messages), the samplers work while the trainer trains: the trainer's step
    (training, optimizer, waiting for groups) is one panel, and the sampler's time for the groups
    that step took, which overlaps it, a second one."""
    total = _series(rows, "step_seconds")
    sampler = {f: v for f in SAMPLER_PHASES if (v := _series(rows, f)) is not None}
    trainer = {f: v for f in TRAINER_PHASES if (v := _series(rows, f)) is not None}
    if total is None and not sampler and not trainer:
        return None
    decoupled = any("messages_dropped" in r for r in rows)
    if decoupled:
        wait = _series(rows, "wait_seconds")
        in_step = {**trainer, **({"wait_seconds": wait} if wait is not None else {})}
    else:
        in_step = {**sampler, **trainer}
    fig, axes = _new_figure(2 if decoupled and sampler else 1)
    _stack(axes[0], steps, in_step, total)
    where = "trainer (the samplers work meanwhile)" if decoupled else "time per step"
    axes[0].set(title=f"{name}: {where}", ylabel="seconds")
    if decoupled and sampler:
        _stack(axes[1], steps, sampler, None)
        axes[1].set(
            title="sampler: seconds spent on the groups of each step (overlaps the above)", ylabel="seconds"
        )
    return fig


def _stack(ax: Axes, steps: np.ndarray, parts: dict[str, np.ndarray], total: np.ndarray | None) -> None:
    """Phases stacked (a phase missing at some step counts as 0 s there), the remainder of
    `total` as "other", and `total` itself as a line."""
    values = {k: np.nan_to_num(v) for k, v in parts.items()}
    if total is not None:
        values["other"] = np.clip(np.nan_to_num(total) - sum(values.values(), np.zeros_like(steps)), 0, None)
    if values:
        ax.stackplot(steps, *values.values(), labels=[k.removeprefix("time_") for k in values], alpha=0.7)
    if total is not None:
        ax.plot(steps, total, color="black", linewidth=1, label="step_seconds")
    ax.legend(loc="upper left", fontsize="small")


def _overlay(
    fields: tuple[str, ...],
    title: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    needs: str | None = None,
) -> Callable[[str, np.ndarray, list[dict], int], Figure | None]:
    """Several fields on one axis (only if `needs` is among them); a field logged only at some
    steps (eval_*) is drawn as points."""

    def plot(name: str, steps: np.ndarray, rows: list[dict], smooth: int) -> Figure | None:
        present = {f: v for f in fields if (v := _series(rows, f)) is not None}
        if not present or (needs is not None and needs not in present):
            return None
        fig, (ax,) = _new_figure()
        for field, values in present.items():
            finite = np.isfinite(values)
            if finite.sum() < len(values):  # sparse: evaluated every eval_steps
                ax.plot(steps[finite], values[finite], marker="o", label=field)
            else:
                _line(ax, steps, values, field, smooth)
        ax.set(title=f"{name}: {title}", ylabel=ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.legend(loc="best")
        return fig

    return plot


FIGURES = {
    "reward.png": _plot_reward,
    "accuracy.png": _plot_accuracy,
    "kl.png": _single("kl", "KL to reference", "kl"),
    "completion_length.png": _single("completion_length_mean", "completion length", "tokens"),
    # a collapsing policy's entropy falls towards 0, an exploding one's climbs
    "entropy.png": _single("entropy", "policy entropy on completion tokens", "nats"),
    "clipping.png": _overlay(
        ("clip_ratio_low", "clip_ratio_high"), "clipped (low: A < 0, high: A > 0)", "fraction"
    ),
    # grpo.dynamic_sampling: what the batches cost beyond the groups trained on
    "dynamic_sampling.png": _overlay(
        ("groups_filtered", "generation_overhead", "zero_variance_groups"),
        "dynamic sampling",
        "per step",
        needs="groups_filtered",
    ),
    "loss.png": _plot_loss,
    "timing.png": _plot_timing,
    # sft, rm, dpo and ppo runs
    "eval_loss.png": _overlay(("loss", "eval_loss"), "train and held-out loss", "loss", needs="eval_loss"),
    "perplexity.png": _overlay(("eval_perplexity",), "held-out perplexity", "perplexity"),
    "preference_accuracy.png": _overlay(
        ("accuracy", "eval_accuracy", "reward_accuracy", "eval_reward_accuracy"),
        "chosen scored above rejected",
        "accuracy",
        (-0.02, 1.02),
    ),
    "margins.png": _overlay(
        ("margin_mean", "eval_margin_mean", "reward_margin", "eval_reward_margin"),
        "chosen minus rejected",
        "margin",
    ),
    "cost_sign.png": _overlay(  # a harmless cost model's classification term
        ("classification_accuracy", "eval_classification_accuracy"),
        "score sign matches the safety label",
        "accuracy",
        (-0.02, 1.02),
    ),
    "value.png": _overlay(("value_loss", "explained_variance"), "critic", "value"),
    "safe_mm.png": _plot_safe_mm,
}


def plot_run(run_dir: Path, out_dir: Path | None = None, *, smooth: int = 0) -> list[Path]:
    """Write the run's PNG figures (default `run_dir/plots`); a figure whose fields are all absent is skipped."""
    run_dir = Path(run_dir)
    rows = _load_rows(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = np.array([float(r["step"]) for r in rows])
    name = run_dir.resolve().name
    written = []
    for filename, draw in FIGURES.items():
        fig = draw(name, steps, rows, smooth)
        if fig is not None:
            written.append(_save(fig, out_dir / filename))
    return written


# (figure, fields that mean the same thing: the first one a run has is drawn, label, y range, whether
# runs of different methods may share the figure: an accuracy does, a GRPO loss and an SFT loss or an
# RM score margin and a DPO implicit-reward margin do not, so those are compared within a method)
COMPARE = (
    ("compare_accuracy.png", ("answer_accuracy",), "answer accuracy", (-0.02, 1.02), True),
    ("compare_reward.png", ("reward_mean",), "reward", None, True),
    ("compare_entropy.png", ("entropy",), "policy entropy", None, True),
    ("compare_loss.png", ("loss",), "training loss", None, False),
    ("compare_eval_loss.png", ("eval_loss",), "held-out loss", None, False),
    ("compare_eval_perplexity.png", ("eval_perplexity",), "held-out perplexity", None, False),
    (
        "compare_preference_accuracy.png",
        ("accuracy", "reward_accuracy"),
        "chosen ranked first",
        (-0.02, 1.02),
        True,
    ),
    (
        "compare_eval_preference_accuracy.png",
        ("eval_accuracy", "eval_reward_accuracy"),
        "held-out: chosen ranked first",
        (-0.02, 1.02),
        True,
    ),
    # DPO's own implicit-reward margin first: Safe-MM-DPO rows also hold the data's reward-model margin
    ("compare_margin.png", ("reward_margin", "margin_mean"), "chosen minus rejected", None, False),
    (
        "compare_eval_margin.png",
        ("eval_reward_margin", "eval_margin_mean"),
        "held-out: chosen minus rejected",
        None,
        False,
    ),
)


def run_method(run_dir: Path) -> str | None:
    """The `method` of a run's config.yaml (grpo, sft, rm, dpo, ppo); None without one."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    import yaml  # only `tandem plot` of several runs reads a config

    config = yaml.safe_load(path.read_text())
    method = config.get("method") if isinstance(config, dict) else None
    return method if isinstance(method, str) else None


def plot_runs(run_dirs: list[Path], out_dir: Path, *, smooth: int = 0) -> list[Path]:
    """Overlay several runs, one figure per quantity at least two of them recorded (GRPO/PPO:
    accuracy, reward, loss; SFT/RM/DPO: loss, held-out loss and perplexity, preference accuracy,
    margins). Runs of different methods (their config.yaml's `method`) share only the figures
    whose quantity means the same for both; losses and margins get one figure per method
    (`compare_loss-<method>.png`). Nothing in common is a ValueError that says what each run
    recorded; no empty folder is left."""
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run folder")
    runs = [_load_rows(Path(d)) for d in run_dirs]
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) < len(names):  # same folder name under different parents: label by full path
        names = [str(d) for d in run_dirs]
    methods = [run_method(Path(d)) for d in run_dirs]
    if len(set(methods)) > 1:
        names = [f"{name} ({method or 'method unknown'})" for name, method in zip(names, methods)]
    panels = compare_panels(names, runs, methods)
    if not panels:
        recorded = "; ".join(
            f"{name}: {', '.join(f for f in _compared_fields() if _series(rows, f) is not None) or 'none'}"
            for name, rows in zip(names, runs)
        )
        raise ValueError(
            "nothing to compare: no two of these runs recorded a quantity that means the same for both "
            f"(what each recorded: {recorded}). Runs of different methods share accuracy, reward and "
            "preference accuracy only; losses and margins are compared between runs of the same method"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _save(_compare_figure(curves, title, ylabel, ylim, smooth), out_dir / filename)
        for filename, title, ylabel, ylim, curves in panels
    ]


def compare_panels(names: list[str], runs: list[list[dict]], methods: list[str | None]) -> list[tuple]:
    """The compare figures to draw: (filename, title, ylabel, ylim, [(label, steps, values)]), one per
    COMPARE entry that two runs share (per method where the quantity is the method's own)."""
    mixed = len(set(methods)) > 1
    panels = []
    for filename, fields, ylabel, ylim, across_methods in COMPARE:
        sets: dict[str | None, list] = {}  # method (None: all runs together) -> its curves
        for label, rows, method in zip(names, runs, methods):
            field = next((f for f in fields if _series(rows, f) is not None), None)
            if field is not None:
                steps = np.array([float(r["step"]) for r in rows])
                label = label if len(fields) == 1 else f"{label}: {field}"
                sets.setdefault(None if across_methods else method, []).append(
                    (label, steps, _series(rows, field))
                )
        for method, curves in sets.items():
            if len(curves) < 2:
                continue
            if mixed and not across_methods:
                kind = method or "method unknown"
                name = f"{Path(filename).stem}-{method or 'unknown'}.png"
                panels.append((name, f"{ylabel} ({len(curves)} {kind} runs)", ylabel, ylim, curves))
            else:
                panels.append((filename, f"{ylabel} ({len(curves)} runs)", ylabel, ylim, curves))
    return panels


def _compared_fields() -> list[str]:
    return [f for _, fields, *_ in COMPARE for f in fields]


def _compare_figure(
    curves: list[tuple[str, np.ndarray, np.ndarray]],
    title: str,
    ylabel: str,
    ylim: tuple[float, float] | None,
    smooth: int,
) -> Figure:
    fig, (ax,) = _new_figure()
    for label, steps, values in curves:
        finite = np.isfinite(values)
        if finite.sum() < len(values):  # sparse: evaluated every eval_steps
            ax.plot(steps[finite], values[finite], marker="o", label=label)
        else:
            _line(ax, steps, values, label, smooth)
    ax.set(title=title, ylabel=ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(loc="best", fontsize="small")
    return fig
