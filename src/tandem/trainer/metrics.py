"""The record of a run (DESIGN.md section 7): `metrics.jsonl` rows, sample dumps, optional TensorBoard/W&B.

Non-finite floats (NaN, inf) are written as JSON `null`: a line holding a bare `NaN` is not valid JSON
for other tools (jq, pandas' strict readers, browsers). Readers should treat `null` as "not a number".
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from tandem.atomic import atomic_write_text
from tandem.runlog import STEP_LOGGER  # runlog.attach_run_log sends it to train.log only

REQUIRED_FIELDS: tuple[str, ...] = (
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "answer_accuracy",
    "format_accuracy",
    "loss",
    "kl",
    "clip_fraction",
    "grad_norm",
    "lr",
    "tokens_generated",
    "step_seconds",
    "wait_seconds",
    "staleness_mean",
    "groups_dropped_stale",
)
# what the rows of sft, rm and dpo runs hold at least (each adds its own: eval_loss, accuracy, ...)
SUPERVISED_FIELDS: tuple[str, ...] = ("step", "epoch", "loss", "grad_norm", "lr", "step_seconds")
METRICS_FILE = "metrics.jsonl"
# "jsonl" is always written; naming it (or "none") in report_to is accepted and changes nothing.
REPORT_TO_CHOICES = ("jsonl", "none", "tensorboard", "wandb")
# an RL row's fields under the names TRL's GRPOTrainer logs (trl 1.x), so that its dashboards read
# tandem's runs: written to TensorBoard and W&B beside tandem's own names, never to metrics.jsonl.
# Fields TRL names alike (reward_std, kl, entropy, frac_reward_zero_std, loss, grad_norm) need none.
TRL_NAMES = {
    "reward_mean": "reward",
    "completion_length_mean": "completions/mean_length",
    "clip_ratio_low": "clip_ratio/low_mean",
    "clip_ratio_high": "clip_ratio/high_mean",
    "clip_fraction": "clip_ratio/region_mean",
    "lr": "learning_rate",
}


def trl_aliases(row: dict, reward_names: Sequence[str] = ()) -> dict[str, float]:
    """The TRL-named copies of a (JSON-safe) RL row's numbers: TRL_NAMES, `rewards/<name>/mean` for
    each reward's `reward_<name>`, and completions/clipped_ratio, the fraction cut at max_new_tokens
    (1 - finished_fraction). Fields the row lacks, or holds as null, give none."""
    pairs = [(TRL_NAMES[k], v) for k, v in row.items() if k in TRL_NAMES]
    pairs += [(f"rewards/{name}/mean", row.get(f"reward_{name}")) for name in reward_names]
    finished = row.get("finished_fraction")
    if _is_number(finished):
        pairs.append(("completions/clipped_ratio", 1.0 - finished))
    return {tag: value for tag, value in pairs if _is_number(value)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def to_json_safe(value: Any) -> Any:
    """Turn tensors, numpy values, paths and tuples into plain JSON values; non-finite floats -> None."""
    torch = sys.modules.get("torch")  # only a process that imported torch can hand us a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    elif isinstance(value, (np.generic, np.ndarray)):
        value = value.item() if value.size == 1 else value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write a {type(value).__name__} to a run record: {value!r}")


def _atomic_write_lines(path: Path, lines: list[str]) -> None:
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def read_metrics(path: Path) -> list[dict]:
    """Read a metrics.jsonl. A truncated last line (a crash mid-write) is skipped; a bad line elsewhere raises."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    rows: list[dict] = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e}); the file is corrupt") from e
    return rows


def write_samples(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """Write completions of one step to `run_dir/samples/step-{step:06d}.jsonl` (one JSON object per row)."""
    samples_dir = Path(run_dir) / "samples"
    samples_dir.mkdir(parents=True, exist_ok=True)
    path = samples_dir / f"step-{step:06d}.jsonl"
    _atomic_write_lines(path, [json.dumps(to_json_safe(row), ensure_ascii=False) for row in rows])
    return path


_STEP_LINE_FIELDS = (
    "loss",
    "reward_mean",
    "answer_accuracy",
    "format_accuracy",
    "kl",
    "accuracy",
    "eval_loss",
    "grad_norm",
    "lr",
    "step_seconds",
    "wait_seconds",
    "peak_rss_gb",
    "gpu_memory_peak_gb",
)


def _step_line(row: dict) -> str:
    shown = [f"{k}={row[k]:.4g}" for k in _STEP_LINE_FIELDS if isinstance(row.get(k), (int, float))]
    return f"step {row['step']}: " + " ".join(shown)


def _gpu_memory() -> dict[str, float]:
    """distributed.runtime.gpu_memory where torch is loaded; a torch-free reader (plots) never needs it."""
    if "torch" not in sys.modules:
        return {}
    from tandem.distributed.runtime import gpu_memory

    return gpu_memory()


class MetricsLogger:
    """Appends one row per optimizer step to `run_dir/metrics.jsonl`, mirrored to TensorBoard/W&B if asked
    (with `aliases(row)`'s extra names there, e.g. trl_aliases).

    Each row is flushed when logged, so a crash loses at most the row being written. With
    `resume_step=N` the file is first rewritten (atomically) to keep only rows with step <= N,
    so a resumed run's record has no duplicated steps. Only rank 0 should build one.
    """

    def __init__(
        self,
        run_dir: Path,
        report_to: list[str],
        *,
        resume_step: int | None = None,
        config: dict | None = None,
        required: tuple[str, ...] = REQUIRED_FIELDS,
        aliases: Callable[[dict], dict[str, float]] | None = None,
    ) -> None:
        unknown = sorted(set(report_to) - set(REPORT_TO_CHOICES))
        if unknown:
            raise ValueError(
                f"report_to has unknown entries {unknown}; choose from {list(REPORT_TO_CHOICES)}"
            )
        self.required = required
        self.aliases = aliases  # row -> {other name: value}, for TensorBoard/W&B only (trl_aliases)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if self.path.exists():
            # A crash can leave a partial last row; drop it (and, on resume, rows past the checkpoint).
            rows = read_metrics(self.path)
            if resume_step is not None:
                rows = [r for r in rows if r.get("step", -1) <= resume_step]
            _atomic_write_lines(self.path, [json.dumps(to_json_safe(r), allow_nan=False) for r in rows])
        self._file = self.path.open("a", encoding="utf-8")
        self._tb_writer = self._open_tensorboard() if "tensorboard" in report_to else None
        self._wandb = (
            self._open_wandb(config, resume=resume_step is not None) if "wandb" in report_to else None
        )

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "report_to includes 'tensorboard' but it is not installed: "
                "`pip install tensorboard` (or `pip install tandem[tensorboard]`)"
            ) from e
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _open_wandb(self, config: dict | None, *, resume: bool) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "report_to includes 'wandb' but it is not installed: `pip install wandb`"
            ) from e
        wandb.init(
            project="tandem",
            name=self.run_dir.name,
            config=to_json_safe(config or {}),
            dir=str(self.run_dir),
            resume="allow" if resume else None,
        )
        return wandb

    def log(self, row: dict) -> None:
        """Write one row; it must hold every required key (extra keys are kept)."""
        missing = [k for k in self.required if k not in row]
        if missing:
            raise KeyError(f"metrics row is missing required fields {missing}")
        safe = to_json_safe({**row, **_gpu_memory()})
        step = int(safe["step"])
        logging.getLogger(STEP_LOGGER).info(_step_line(safe))
        self._file.write(json.dumps(safe, allow_nan=False) + "\n")
        self._file.flush()
        extra = {}
        if self.aliases is not None and (self._tb_writer is not None or self._wandb is not None):
            extra = {k: v for k, v in self.aliases(safe).items() if k not in safe}
        if self._tb_writer is not None:
            for key, value in {**safe, **extra}.items():
                if key != "step" and _is_number(value):
                    self._tb_writer.add_scalar(key, value, global_step=step)
            self._tb_writer.flush()
        if self._wandb is not None:
            self._wandb.log({**safe, **extra}, step=step)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
