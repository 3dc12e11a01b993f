"""GRPO variants on the embedded default, side by side: the same config and number of optimizer steps
with and without dynamic sampling, and with GSPO's sequence-level ratio; each run's held-out answer
accuracy (greedy, `tandem eval`), wall-clock and generation cost.

    python benchmarks/grpo_variants.py --update-results                       # every variant, ~25 min each
    python benchmarks/grpo_variants.py --variants dynamic --update-results    # one; the others' entries stay

Each variant is `tandem grpo configs/grpo_tiny.yaml` (a sampler and a trainer process, 60 steps of
4 prompts x 8 completions) plus its overrides, run one after another on the same machine; then
`tandem eval --num-examples 200` on its final model. A results file keeps the entries of variants
not run this time, so variants can be measured in separate sittings (each entry says when).
Runs of this length vary by several points of accuracy between seeds: one run per variant shows
the cost and the direction, not a small difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import add_out_arguments, results_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/grpo_tiny.yaml"
VARIANTS = {
    "baseline": [],
    # DAPO: groups whose 8 completions all score the same are replaced by fresh prompts' groups
    "dynamic": ["grpo.dynamic_sampling=true"],
    # GSPO: one length-normalised ratio per sequence, clipped with the paper's ranges
    "gspo": [
        "grpo.importance_sampling_level=sequence",
        "grpo.clip_eps_low=3e-4",
        "grpo.clip_eps_high=4e-4",
    ],
}


def window_mean(rows: list[dict], name: str, first: int, last: int) -> float | None:
    values = [r[name] for r in rows if first <= r["step"] <= last and isinstance(r.get(name), int | float)]
    return round(statistics.fmean(values), 4) if values else None


def run_variant(name: str, overrides: list[str], out_dir: Path, steps: int) -> dict:
    tandem = [sys.executable, "-m", "tandem"]
    experiment = f"variant_{name}"
    run_dir = out_dir / experiment
    argv = [*tandem, "grpo", CONFIG, f"output_dir={out_dir}", f"experiment_name={experiment}"]
    argv += [f"training.max_steps={steps}", *overrides]
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True)
    wall = time.perf_counter() - start
    report = out_dir / f"{experiment}_eval.json"
    subprocess.run(
        [
            *tandem,
            "eval",
            "--model",
            str(run_dir / "final"),
            "--num-examples",
            "200",
            "--output",
            str(report),
        ],
        cwd=ROOT,
        check=True,
    )
    return {"overrides": overrides, "wall_seconds": round(wall, 1), **summarize(run_dir, report, steps)}


def summarize(run_dir: Path, report: Path, steps: int) -> dict:
    """A finished variant's figures, from its run folder and its `tandem eval` report."""
    held_out = json.loads(report.read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r]
    tenth = max(1, steps // 6)
    step_seconds = [r["step_seconds"] for r in rows[1:] if isinstance(r.get("step_seconds"), int | float)]
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.stat().st_mtime)),
        "steps": len(rows),
        "step_seconds_mean": window_mean(rows, "step_seconds", 2, steps),
        # the median resists the minutes when another job shared the machine
        "step_seconds_median": round(statistics.median(step_seconds), 2) if step_seconds else None,
        "tokens_generated": sum(r.get("tokens_generated", 0) for r in rows),  # of the groups trained on
        # dynamic sampling's extra generation: the dropped groups' tokens (generation_overhead x tokens)
        "tokens_generated_dropped": round(
            sum((r.get("generation_overhead") or 0) * r.get("tokens_generated", 0) for r in rows)
        ),
        "groups_filtered": sum(r.get("groups_filtered", 0) or 0 for r in rows),
        "zero_variance_groups": sum(r.get("zero_variance_groups", 0) or 0 for r in rows),
        "held_out_answer_accuracy": held_out.get("answer_accuracy"),
        "held_out_format_accuracy": held_out.get("format_accuracy"),
        "train_answer_accuracy_first": window_mean(rows, "answer_accuracy", 1, tenth),
        "train_answer_accuracy_last": window_mean(rows, "answer_accuracy", steps - tenth + 1, steps),
        "train_format_accuracy_last": window_mean(rows, "format_accuracy", steps - tenth + 1, steps),
        "entropy_last": window_mean(rows, "entropy", steps - tenth + 1, steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs-dir", default="runs/variants", help="where the runs go")
    parser.add_argument(
        "--summarize", action="store_true", help="recompute the entries from finished runs, run nothing"
    )
    add_out_arguments(parser, "grpo_variants")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; choose from {list(VARIANTS)}")
    out = results_file(args, "grpo_variants")
    results = json.loads(out.read_text()) if out.is_file() else {"config": CONFIG, "variants": {}}
    for name in names:
        print(f"[grpo_variants] {name}: {' '.join(VARIANTS[name]) or '(the config as it is)'}", flush=True)
        runs = ROOT / args.runs_dir
        if args.summarize:
            entry = results["variants"].get(name, {"overrides": VARIANTS[name]})
            entry.update(summarize(runs / f"variant_{name}", runs / f"variant_{name}_eval.json", args.steps))
            results["variants"][name] = entry
        else:
            results["variants"][name] = run_variant(name, VARIANTS[name], runs, args.steps)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")  # after each variant: a long sitting keeps it
        print(json.dumps(results["variants"][name]), flush=True)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
