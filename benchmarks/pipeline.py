"""The decoupled pipeline against the colocated loop, on the same cores, in one sitting.

  .venv/bin/python benchmarks/pipeline.py [--steps 8] [--config configs/grpo_tiny.yaml]

Runs the same config twice for `--steps` optimizer steps: once as one process
(`pipeline.mode=colocated`, all cores) and once as `tandem grpo` starts it (a sampler and a trainer
process, the cores split between them). Reports the median step time after the first step,
generated tokens per second of wall time (the fair measure: completion lengths differ a little
between the runs), the time the trainer waited for groups, and the sampler's own generation speed.
Writes benchmarks/results/runs/pipeline-<time>.json (`--update-results`: the tracked
benchmarks/results/pipeline.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py

HERE = Path(__file__).resolve().parent


def run(config: str, steps: int, out: Path, mode: str, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "grpo",
        config,
        f"experiment_name={mode}",
        f"output_dir={out}",
        f"training.max_steps={steps}",
        "training.save_steps=0",
        "training.sample_log_steps=0",
        f"pipeline.mode={mode}",
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    run_dir = out / mode
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # the first step pays for loading and warm-up
    span = sum(r["step_seconds"] for r in timed)
    result = {
        "steps": len(rows),
        "wall_seconds_incl_load": wall,
        "step_seconds_median": statistics.median(r["step_seconds"] for r in timed),
        "step_seconds_mean": span / len(timed),
        "tokens_per_second": sum(r["tokens_generated"] for r in timed) / span,
        "wait_seconds_mean": statistics.fmean(r["wait_seconds"] for r in timed),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in timed),
        "groups_dropped_stale": sum(r["groups_dropped_stale"] for r in rows),
        "completion_length_mean": statistics.fmean(r["completion_length_mean"] for r in timed),
        "trainer_peak_rss_gb": max(r["peak_rss_gb"] for r in rows),
    }
    sampler_log = run_dir / "samplers" / "s0.jsonl"
    if sampler_log.is_file():
        batches = [json.loads(x) for x in sampler_log.read_text().splitlines()][1:]
        result["sampler_generate_tokens_per_second"] = statistics.median(
            b["generate_tokens_per_second"] for b in batches
        )
        result["sampler_wait_trainer_seconds_mean"] = statistics.fmean(
            b["time_wait_trainer"] for b in batches
        )
    else:
        result["generate_tokens_per_second"] = statistics.median(
            r["generate_tokens_per_second"] for r in timed
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--config", default=str(HERE.parent / "configs" / "grpo_tiny.yaml"))
    add_out_arguments(parser, "pipeline")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    args.out = results_file(args, "pipeline")

    with tempfile.TemporaryDirectory() as tmp:
        colocated = run(args.config, args.steps, Path(tmp), "colocated", args.overrides)
        decoupled = run(args.config, args.steps, Path(tmp), "decoupled", args.overrides)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "colocated": colocated,
        "decoupled": decoupled,
        "ratios": {
            "step_time_decoupled_vs_colocated": decoupled["step_seconds_mean"]
            / colocated["step_seconds_mean"],
            "tokens_per_second_decoupled_vs_colocated": decoupled["tokens_per_second"]
            / colocated["tokens_per_second"],
            "trainer_wait_share": decoupled["wait_seconds_mean"] / decoupled["step_seconds_mean"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
