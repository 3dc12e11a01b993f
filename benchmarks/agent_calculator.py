"""Agentic RL on the embedded default, measured: the arithmetic problems trained with a calculator
tool (configs/agent_calculator_tiny.yaml: multi-turn episodes, 3 worked examples that call the tool)
against the same run without tools (the same worked examples answered in one turn, the same system
prompt without the tool sentence). The run's own held-out evaluation (200 problems, greedy) before
training, and the same evaluation of the final model (and of any checkpoint given to --evaluate),
give answer accuracy, format, the tool-call rate and turns.

    python benchmarks/agent_calculator.py --update-results            # both runs, one after the other
    python benchmarks/agent_calculator.py --side-by-side --update-results
    python benchmarks/agent_calculator.py --summarize --update-results   # from finished runs

`--side-by-side` starts both runs at once (their own ports): half the wall-clock on this 2-core
machine, and their step times are then those of a shared machine. One run per arm shows the
direction and the cost; runs of this length vary by several points between seeds.
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
CONFIG = "configs/agent_calculator_tiny.yaml"
NO_TOOLS_PROMPT = (
    "You are a careful math tutor. Think inside <think> </think>, then write only the final number "
    "inside <answer> </answer>."
)
ARMS = {
    "tools": [],
    # the same problems, shots (their questions, answered in one turn) and rewards, no agent
    "no_tools": [
        "agent.tools=[]",
        "data.shots=arithmetic",
        f"data.system_prompt={NO_TOOLS_PROMPT}",
    ],
}
PORTS = {"tools": (5571, 5572), "no_tools": (5573, 5574)}
EVAL_FIELDS = ("accuracy", "reward_format", "tool_calls_mean", "turns_mean", "completion_length")


def window_mean(rows: list[dict], name: str, first: int, last: int) -> float | None:
    values = [r[name] for r in rows if first <= r["step"] <= last and isinstance(r.get(name), int | float)]
    return round(statistics.fmean(values), 4) if values else None


def command(name: str, runs: Path, steps: int) -> list[str]:
    data_port, sync_port = PORTS[name]
    return [
        sys.executable,
        "-m",
        "tandem",
        "grpo",
        CONFIG,
        f"output_dir={runs}",
        f"experiment_name=agent_{name}",
        f"training.max_steps={steps}",
        f"eval.steps={steps}",
        f"pipeline.data_port={data_port}",
        f"pipeline.sync_port={sync_port}",
        *ARMS[name],
    ]


def summarize(run_dir: Path, steps: int) -> dict:
    """An arm's figures from its metrics.jsonl: the held-out evaluation before training
    (`eval_*_initial`) and the training rows' first and last sixths. (A decoupled run does not log
    the evaluation of its last version: the sampler makes it after the trainer has finished; the
    final model is evaluated here instead, `evaluate_model`.)"""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    initial = next((r for r in rows if "eval_accuracy_initial" in r), {})
    rows = [r for r in rows if "step" in r]
    last = rows[-1]["step"] if rows else steps  # a run stopped early: its windows end where it did
    tenth = max(1, last // 6)
    step_seconds = [r["step_seconds"] for r in rows[1:] if isinstance(r.get("step_seconds"), int | float)]
    entry = {
        "when": time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime((run_dir / "metrics.jsonl").stat().st_mtime)
        ),
        "steps": len(rows),
        "eval_num_examples": initial.get("eval_num_examples_initial"),
        "step_seconds_median": round(statistics.median(step_seconds), 2) if step_seconds else None,
        "tokens_generated": sum(r.get("tokens_generated", 0) for r in rows),
    }
    for field in EVAL_FIELDS:
        entry[f"held_out_{field}_before"] = initial.get(f"eval_{field}_initial")
    calls = [
        (r["step"], r["tool_calls_mean"]) for r in rows if isinstance(r.get("tool_calls_mean"), int | float)
    ]
    if calls:  # how fast the sampled episodes give up the tool
        entry["train_tool_calls_mean_by_step"] = [round(v, 4) for _, v in calls]
        entry["first_step_without_tool_calls"] = next((s for s, v in calls if v == 0), None)
    for field in ("answer_accuracy", "tool_calls_mean", "turns_mean", "episode_tokens_mean", "tool_errors"):
        entry[f"train_{field}_first"] = window_mean(rows, field, 1, tenth)
        entry[f"train_{field}_last"] = window_mean(rows, field, last - tenth + 1, last)
    return entry


def evaluate_model(name: str, model_dir: str, step: int) -> dict:
    """The run's held-out evaluation (its eval.* settings, greedy, the same problems) of a saved
    model of arm `name`, e.g. a checkpoint: what the run itself would log at that step."""
    import torch

    from tandem.config import load_config
    from tandem.models.loading import load_tokenizer
    from tandem.sampler.evaluation import Evaluator
    from tandem.sampler.rollout import build_rollout

    overrides = [*ARMS[name], f"model.policy={model_dir}", "grpo.kl_coef=0", "eval.steps=1"]
    cfg = load_config(ROOT / CONFIG, overrides)
    rollout = build_rollout(
        cfg, None, load_tokenizer(model_dir), torch.Generator().manual_seed(cfg.seed), "cpu"
    )
    try:
        fields = Evaluator(cfg, rollout).run(step)
    finally:
        if rollout.agent is not None:
            rollout.agent.close()
    return {field: fields.get(f"eval_{field}") for field in EVAL_FIELDS} | {"model": model_dir}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs-dir", default="runs/agent_calculator", help="where the runs go")
    parser.add_argument("--side-by-side", action="store_true", help="both runs at once (own ports)")
    parser.add_argument(
        "--summarize", action="store_true", help="recompute the entries from the runs' records, run nothing"
    )
    parser.add_argument(
        "--evaluate",
        metavar="ARM=MODEL_DIR",
        action="append",
        default=[],
        help="evaluate a saved model of an arm (a checkpoint's model/ folder) as the run would, at --at-step",
    )
    parser.add_argument("--at-step", type=int, help="the step of the models given to --evaluate")
    add_out_arguments(parser, "agent_calculator")
    args = parser.parse_args()
    runs = ROOT / args.runs_dir
    out = results_file(args, "agent_calculator")
    results = {"config": CONFIG, "arms": {name: {"overrides": ARMS[name]} for name in ARMS}}
    if out.is_file():  # keep what other sittings measured (checkpoint evaluations, wall-clock)
        results = json.loads(out.read_text())
    if args.evaluate:
        if args.at_step is None:
            parser.error("--evaluate needs --at-step")
        for item in args.evaluate:
            name, _, model_dir = item.partition("=")
            if name not in ARMS or not model_dir:
                parser.error(f"--evaluate takes ARM=MODEL_DIR with ARM one of {list(ARMS)}, got {item!r}")
            measured = evaluate_model(name, model_dir, args.at_step)
            results["arms"][name].setdefault("held_out_at_step", {})[str(args.at_step)] = measured
            print(f"[agent_calculator] {name} at step {args.at_step}: {json.dumps(measured)}", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    walls: dict[str, float] = {}
    if not args.summarize:
        start = time.perf_counter()
        if args.side_by_side:
            procs = {name: subprocess.Popen(command(name, runs, args.steps), cwd=ROOT) for name in ARMS}
            for name, proc in procs.items():
                if proc.wait() != 0:
                    raise SystemExit(f"[agent_calculator] the {name} run failed (exit {proc.returncode})")
                walls[name] = time.perf_counter() - start
        else:
            for name in ARMS:
                subprocess.run(command(name, runs, args.steps), cwd=ROOT, check=True)
                walls[name] = time.perf_counter() - start
                start = time.perf_counter()
    for name in ARMS:
        entry = results["arms"][name]
        entry.update(summarize(runs / f"agent_{name}", args.steps))
        if name in walls:
            entry["wall_seconds"] = round(walls[name], 1)
            entry["side_by_side"] = args.side_by_side
            final = runs / f"agent_{name}" / "final"
            entry.setdefault("held_out_at_step", {})[str(args.steps)] = evaluate_model(
                name, str(final), args.steps
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
