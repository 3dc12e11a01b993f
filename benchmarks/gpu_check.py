"""`make gpu-check`: what only a GPU can show, in one command on a machine with CUDA.

    python benchmarks/gpu_check.py                      # everything (about 10-15 minutes on one H100)
    python benchmarks/gpu_check.py --only colocated-bf16,ddp-nccl
    python benchmarks/gpu_check.py --model /data/Qwen2.5-0.5B-Instruct   # a model folder of your own

It runs the `gpu`-marked tests (tests/gpu: generation, process groups, packed log-probs per
attention implementation, checkpoint maps, weight snapshots on CUDA) and short acceptance runs of
the embedded model (nothing is downloaded): GRPO colocated and decoupled on one GPU, in bf16 and
fp16; DDP, ZeRO-2 and ZeRO-3 groups of one over nccl and over gloo (each with a held-out
evaluation, eval.*, before training and at step 3); the GRPO variants (GSPO, dynamic sampling);
agent episodes with a calculator tool, colocated and decoupled; a sampled `tandem eval`. Each run's
record gives its step seconds, generation tokens/s, `ratio_abs_dev` of its first step (the
on-policy ratio's distance from 1: sampler and trainer scoring the same tokens), sync seconds and
peak GPU memory. The results go to benchmarks/results/gpu_check.json (commit it: it is the record
of what was verified on real hardware) and a pass/fail table is printed; the exit status is 0 only
when everything passed. Without CUDA it exits at once with status 2, saying so.

`--device cpu` runs the same plan on the CPU: only to check this script itself (a test does, with a
tiny model); its results say so and prove nothing about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
CONFIG = "configs/grpo_tiny.yaml"
AGENT_CONFIG = "configs/agent_calculator_tiny.yaml"
RUN_TIMEOUT_S = 300  # per check (--timeout)


@dataclass
class Check:
    name: str
    what: str
    argv: list[str]  # after `tandem`, or a pytest invocation (kind "tests")
    kind: str = "run"  # run: a tandem training run with a metrics.jsonl | tests | eval
    result: dict = field(default_factory=dict)


def short_run(mode: str, precision: str, strategy: str = "none", backend: str = "auto") -> list[str]:
    """Overrides of a 3-step GRPO run of the embedded default, small enough for a minute."""
    sampling_dtype = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}[precision]
    return [
        "training.max_steps=3",
        "training.save_steps=3",
        "training.sample_log_steps=0",
        "grpo.prompts_per_step=4",
        "sampling.num_generations=8",
        "sampling.max_new_tokens=96",
        f"training.mixed_precision={precision}",
        f"sampling.dtype={sampling_dtype}",
        f"pipeline.mode={mode}",
        f"training.dist_backend={backend}",
        # held-out evaluation on the device: before training (trainer or sampler s0) and at step 3
        "eval.steps=3",
        "eval.num_examples=8",
        *(
            [f"training.distributed_strategy={strategy}"]
            if not strategy.startswith("zero")
            else ["training.distributed_strategy=deepspeed", f"training.zero_stage={strategy[-1]}"]
        ),
    ]


def plan(device: str, model: str | None) -> list[Check]:
    gpu = device == "cuda"
    model_override = [f"model.policy={model}"] if model else []
    checks = [
        Check(
            "gpu-tests",
            "the gpu-marked tests (tests/gpu and every test marked gpu)",
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *gpu_test_files()],
            kind="tests",
        )
    ]
    runs = [
        (
            "colocated-bf16",
            "GRPO, sampler and trainer in one process, bf16",
            "colocated",
            "bf16",
            "none",
            "auto",
        ),
        (
            "colocated-fp16",
            "GRPO colocated, fp16 (loss scaling, NaN guard)",
            "colocated",
            "fp16",
            "none",
            "auto",
        ),
        (
            "decoupled-bf16",
            "GRPO, a sampler process and a trainer on one GPU",
            "decoupled",
            "bf16",
            "none",
            "auto",
        ),
        (
            "ddp-nccl",
            "DDP group of one over nccl (CPU collectives over gloo)",
            "colocated",
            "bf16",
            "ddp",
            "nccl",
        ),
        ("ddp-gloo", "DDP group of one over gloo alone (vGPU setups)", "colocated", "bf16", "ddp", "gloo"),
        ("zero2-nccl", "DeepSpeed ZeRO-2 group of one over nccl", "colocated", "bf16", "zero2", "nccl"),
        ("zero2-gloo", "DeepSpeed ZeRO-2 group of one over gloo", "colocated", "bf16", "zero2", "gloo"),
        # ZeRO-3 shards the policy, so it cannot generate in the trainer: decoupled, sampler beside it
        (
            "zero3-nccl",
            "DeepSpeed ZeRO-3 group of one over nccl, fed by a sampler",
            "decoupled",
            "bf16",
            "zero3",
            "nccl",
        ),
        (
            "zero3-gloo",
            "DeepSpeed ZeRO-3 group of one over gloo, fed by a sampler",
            "decoupled",
            "bf16",
            "zero3",
            "gloo",
        ),
    ]
    for name, what, mode, precision, strategy, backend in runs:
        if not gpu:  # the CPU self-check: fp32, gloo (what this CPU can run)
            precision, backend = "no", "gloo" if strategy != "none" else "auto"
        overrides = short_run(mode, precision, strategy, backend) + model_override
        if mode == "decoupled":
            where = ["--sampling-devices", "0" if gpu else "cpu", "--training-devices", "0" if gpu else "cpu"]
            argv = ["launch", CONFIG, *where, *overrides]
        else:
            argv = ["grpo", CONFIG, f"training.device={device}", *overrides]
        checks.append(Check(name, what, argv))
    # the GRPO variants and agent episodes (multi-turn, a calculator tool) on the same short runs
    precision = "bf16" if gpu else "no"
    variants = [
        "grpo.importance_sampling_level=sequence",
        "grpo.dynamic_sampling=true",
        "grpo.mask_truncated_completions=true",
    ]
    checks.append(
        Check(
            "variants-colocated",
            "GSPO's sequence ratio, dynamic sampling and truncation masking, colocated",
            ["grpo", CONFIG, f"training.device={device}", *short_run("colocated", precision), *variants]
            + model_override,
        )
    )
    for mode in ("colocated", "decoupled"):
        overrides = short_run(mode, precision) + model_override
        if mode == "decoupled":
            where = ["--sampling-devices", "0" if gpu else "cpu", "--training-devices", "0" if gpu else "cpu"]
            argv = ["launch", AGENT_CONFIG, *where, *overrides]
        else:
            argv = ["grpo", AGENT_CONFIG, f"training.device={device}", *overrides]
        checks.append(Check(f"agent-{mode}", f"agent episodes with the calculator tool, {mode}", argv))
    eval_model = model or "embedded"
    checks.append(
        Check(
            "eval-sampled",
            "tandem eval with sampling (temperature 1, 2 samples) on the built-in problems",
            ["eval", "--model", eval_model, "--dataset", "synthetic", "--num-examples", "32"]
            + ["--temperature", "1.0", "--num-samples", "2", "--device", device],
            kind="eval",
        )
    )
    return checks


def gpu_test_files() -> list[str]:
    """tests/gpu and every other test file that marks a test `gpu`: collecting only these keeps a
    GPU image without the suite's optional packages (datasets, trl, vllm) out of the way."""
    files = {"tests/gpu"}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if "mark.gpu" in text and not path.is_relative_to(ROOT / "tests" / "gpu"):
            files.add(str(path.relative_to(ROOT)))
    return sorted(files)


def with_ports(check: Check, slot: int) -> list[str]:
    """Checks that run side by side (--jobs) each get their own pipeline and rendezvous ports."""
    if check.kind != "run" or slot == 0:
        return check.argv
    base = 30000 + 10 * slot
    argv = [*check.argv, f"pipeline.data_port={base}", f"pipeline.sync_port={base + 1}"]
    if argv[0] == "launch":
        argv[1:1] = ["--master-port", str(base + 2)]
    return argv


def run_check(check: Check, workdir: Path, env: dict, timeout_s: float, slot: int = 0) -> None:
    start = time.perf_counter()
    if check.kind == "tests":
        argv = check.argv
    else:
        argv = [sys.executable, "-m", "tandem", *with_ports(check, slot)]  # no console script needed
        if check.kind == "run":
            argv += [f"output_dir={workdir}", f"experiment_name={check.name}"]
        else:
            argv += ["--output", str(workdir / f"{check.name}.json")]
    log_path = workdir / f"{check.name}.log"
    with open(log_path, "w") as log:
        # its own process group: a check that overruns is stopped with everything it started
        # (a launch's sampler and trainer ranks), not only its first process
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    check.result = {"seconds": round(time.perf_counter() - start, 1), "exit": status, "passed": status == 0}
    if check.kind == "run":
        check.result.update(run_figures(workdir / check.name))
        check.result["passed"] &= check.result.get("steps", 0) > 0 and check.result.get("loss_finite", False)
        check.result["passed"] &= check.result.get("evaluated_initial", False)
    elif check.kind == "eval" and (workdir / f"{check.name}.json").is_file():
        report = json.loads((workdir / f"{check.name}.json").read_text())
        check.result.update(answer_accuracy=report.get("answer_accuracy"), eval_seconds=report.get("seconds"))
    elif check.kind == "tests":
        check.result.update(pytest_counts(log_path.read_text(errors="replace")))
    if not check.result["passed"]:
        check.result["log_tail"] = log_path.read_text(errors="replace")[-3000:]


def pytest_counts(log: str) -> dict:
    """{"tests_passed": 17, "tests_skipped": 1, ...} from pytest's closing summary line, and the
    reasons of the skips (on a GPU machine a skip means a path that was not verified)."""
    counts = {}
    lines = log.strip().splitlines()
    for part in (lines[-1] if lines else "").strip("= ").split(","):
        words = part.split()
        if len(words) >= 2 and words[0].isdigit():
            counts[f"tests_{words[1]}"] = int(words[0])
    skipped = [line.split("] ", 1)[-1] for line in lines if line.startswith("SKIPPED")]
    return {**counts, **({"skipped_because": skipped} if skipped else {})}


def merge(paths: list[str]) -> dict:
    """One record from the partial records of several invocations on the same machine (a machine
    lent by the call, say, where each call holds part of the work): their checks together, each
    invocation's time and --jobs kept."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    names = {r["facts"].get("device_name") for r in records}
    if len(names) != 1:
        raise SystemExit(f"--merge: the records come from different devices {sorted(map(str, names))}")
    checks = {}
    for record in records:
        clash = set(checks) & set(record["checks"])
        if clash:
            raise SystemExit(f"--merge: checks {sorted(clash)} appear in more than one record")
        checks.update(record["checks"])
    return {
        "facts": records[0]["facts"],
        "invocations": [
            {
                "when": r["when"],
                "seconds": r["seconds"],
                "jobs": r.get("jobs", 1),
                "checks": list(r["checks"]),
            }
            for r in records
        ],
        "model": records[0]["model"],
        "checks": checks,
        "not_run": sorted({n for r in records for n in r.get("not_run", [])} - set(checks)),
        "passed": all(r["passed"] for r in records),
    }


def run_figures(run_dir: Path) -> dict:
    """What a short run's metrics.jsonl says: its speed, the on-policy ratio's first-step distance from
    1, sync time and peak GPU memory (steps after the first: the first pays for warm-up)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {"steps": 0}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r and "step_seconds" in r]
    if not rows:
        return {"steps": 0}
    later = rows[1:] or rows

    def mean(field_name: str, among: list[dict]) -> float | None:
        values = [r[field_name] for r in among if isinstance(r.get(field_name), int | float)]
        return round(statistics.fmean(values), 4) if values else None

    sampler_rows = []
    for sampler_log in (run_dir / "samplers").glob("*.jsonl"):
        lines = [line for line in sampler_log.read_text().splitlines() if line.strip()]
        sampler_rows += [json.loads(line) for line in lines[1:]]  # its first batch pays for warm-up

    def peak(among: list[dict]) -> float | None:
        values = [
            r["gpu_memory_peak_gb"] for r in among if isinstance(r.get("gpu_memory_peak_gb"), int | float)
        ]
        return max(values) if values else None

    return {
        "steps": len(rows),
        "step_seconds": mean("step_seconds", later),
        "generate_tokens_per_second": mean("generate_tokens_per_second", later + sampler_rows),
        "ratio_abs_dev_first_step": rows[0].get("ratio_abs_dev"),
        "sync_seconds": mean("sync_seconds", later),
        "gpu_memory_peak_gb": peak(rows),  # the trainer's
        "sampler_gpu_memory_peak_gb": peak(sampler_rows),  # decoupled: the sampler's, on the same GPU
        "loss_finite": all(isinstance(r.get("loss"), int | float) and r["loss"] == r["loss"] for r in rows),
        "evaluated_initial": any("eval_policy_version_initial" in r for r in rows),  # eval.* ran there
    }


def device_facts(device: str) -> dict:
    import torch

    facts = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(
            device_name=torch.cuda.get_device_name(0),
            device_memory_gb=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            bf16_supported=torch.cuda.is_bf16_supported(),
            visible_devices=torch.cuda.device_count(),
        )
        try:
            import flash_attn

            facts["flash_attn"] = flash_attn.__version__
        except ImportError:
            facts["flash_attn"] = None
    else:
        facts["device_name"] = platform.processor() or platform.machine()
        facts["note"] = "a CPU self-check of this script: it proves nothing about GPUs"
    return facts


def table(checks: list[Check]) -> str:
    def cell(result: dict, key: str, width: int, fmt: str = "{:.3g}") -> str:
        value = result.get(key)
        return f"{fmt.format(value) if isinstance(value, int | float) else '-':>{width}}"

    lines = [
        f"{'check':<16} {'result':<7} {'s':>6} {'step s':>7} {'tok/s':>8} {'ratio dev':>10} {'GPU GB':>7}"
    ]
    for c in checks:
        r = c.result
        if r:
            lines.append(
                f"{c.name:<16} {'pass' if r['passed'] else 'FAIL':<7} {r['seconds']:>6.0f} "
                f"{cell(r, 'step_seconds', 7)} {cell(r, 'generate_tokens_per_second', 8, '{:.0f}')} "
                f"{cell(r, 'ratio_abs_dev_first_step', 10)} {cell(r, 'gpu_memory_peak_gb', 7)}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local model folder to use instead of the embedded model")
    parser.add_argument("--only", help="comma-separated check names (default: all)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=f"results file (default: {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--skip", help="comma-separated check names to leave out")
    parser.add_argument(
        "--jobs", type=int, default=1, help="checks run side by side (timings then share the GPU)"
    )
    parser.add_argument(
        "--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds before a check is stopped"
    )
    parser.add_argument(
        "--workdir", help="keep the runs and their logs here (default: a temporary folder, removed)"
    )
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument(
        "--merge", nargs="+", metavar="RECORD", help="join partial records (--only/--skip runs) into --out"
    )
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge(args.merge)
        out = Path(args.out) if args.out else RESULTS
        out.write_text(json.dumps(merged, indent=2) + "\n")
        print(f"{len(merged['checks'])} checks, {'all passed' if merged['passed'] else 'FAILED'}; in {out}")
        return 0 if merged["passed"] else 1

    checks = plan(args.device, args.model)
    names = [c.name for c in checks]
    for option in ("only", "skip"):
        unknown = set((getattr(args, option) or "").split(",")) - set(names) - {""}
        if unknown:
            parser.error(f"--{option}: unknown check(s) {sorted(unknown)}; choose from {names}")
    if args.only:
        checks = [c for c in checks if c.name in args.only.split(",")]
    if args.skip:
        checks = [c for c in checks if c.name not in args.skip.split(",")]
    if args.list:
        for c in checks:
            print(f"{c.name:<16} {c.what}")
        return 0
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                f"gpu-check needs a CUDA device: torch {torch.__version__} (CUDA build: "
                f"{torch.version.cuda or 'none'}) sees no GPU here. Run it on a machine with one.",
                file=sys.stderr,
            )
            return 2
    # a partial check (--only, --skip) never overwrites the committed record of a whole one
    partial = RESULTS.parent / "runs" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out = Path(args.out) if args.out else (partial if args.only or args.skip else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    started = time.perf_counter()
    facts = device_facts(args.device)

    record_lock = threading.Lock()

    def record() -> dict:
        """The results so far, rewritten after every check: a session stopped midway keeps them."""
        done = [c for c in checks if c.result]
        results = {
            "facts": facts,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(time.perf_counter() - started, 1),
            "model": args.model or "embedded (SmolLM2-135M-Instruct)",
            "jobs": args.jobs,  # > 1: the checks' timings were taken side by side on one GPU
            "checks": {c.name: {"what": c.what, **c.result} for c in done},
            "not_run": [c.name for c in checks if not c.result],
            "passed": len(done) == len(checks) and all(c.result["passed"] for c in done),
        }
        with record_lock:  # checks side by side (--jobs) finish in threads of their own
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(results, indent=2) + "\n")
            os.replace(tmp, out)
        return results

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory()
    with workdir as tmp:
        slots = queue.SimpleQueue()  # port sets: no two checks running side by side share one
        for slot in range(args.jobs):
            slots.put(slot)

        def one(check: Check) -> None:
            slot = slots.get()
            try:
                print(f"[gpu-check] {check.name}: {check.what} ...", flush=True)
                run_check(check, Path(tmp), env, args.timeout, slot)
            finally:
                slots.put(slot)
            print(f"[gpu-check] {check.name}: {'pass' if check.result['passed'] else 'FAIL'}", flush=True)
            record()

        # the gpu tests first and alone (they measure nothing); then the runs, --jobs at a time
        for check in checks:
            if check.kind == "tests":
                one(check)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, [c for c in checks if c.kind != "tests"]))
    results = record()
    print(table(checks))
    print(f"{'all passed' if results['passed'] else 'FAILED'}; results in {out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
