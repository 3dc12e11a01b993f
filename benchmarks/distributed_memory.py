"""Memory per rank of each training strategy on the embedded model, beside the ZeRO arithmetic.

    .venv/bin/python benchmarks/distributed_memory.py [--ranks 2] [--steps 2]

For none (1 process), ddp and DeepSpeed ZeRO-1/2/3 (`--ranks` processes each, gloo on the CPU),
every rank loads SmolLM2-135M as the trainers do (run.load_policy: under ZeRO-3 each rank builds
only its shard, deepspeed.zero.Init; `zero3_whole` is ZeRO-3 with training.zero3_init=false, every
rank loading the whole model first), trains it (fp32, AdamW) for a few optimizer steps on the same
synthetic groups through tandem's real engine and reports:
- after_load_gb: RSS once the model is loaded, before the engine is built (rank 0 of a sharded
  load also read the whole checkpoint, which transformers does on rank 0 alone);
- after_engine_gb: RSS once the engine is built, before any step (DeepSpeed has made its fp32
  partitions and optimizer states by then; torch's AdamW makes its moments at the first step);
- model_state_gb: RSS after the first optimizer step minus RSS before the model was loaded, i.e.
  what the parameters, gradients and AdamW moments (and the engine's buffers) hold at rest;
- peak_gb: peak RSS minus that same baseline (adds the activations and transients of a step);
- theory_gb: the ZeRO paper's accounting for fp32 training, with P parameters and N ranks,
  4P (weights) + 4P (gradients) + 8P (AdamW moments) = 16P bytes, of which ZeRO-1 shards the
  moments, ZeRO-2 the moments and the gradients, ZeRO-3 all three.
Results go to benchmarks/results/runs/distributed_memory-<time>.json (`--update-results`: the tracked
benchmarks/results/distributed_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py

HERE = Path(__file__).resolve().parent
STRATEGIES = {
    "none": ["training.distributed_strategy=none"],
    "ddp": ["training.distributed_strategy=ddp"],
    "zero1": ["training.distributed_strategy=deepspeed", "training.zero_stage=1"],
    "zero2": ["training.distributed_strategy=deepspeed", "training.zero_stage=2"],
    "zero3": ["training.distributed_strategy=deepspeed", "training.zero_stage=3"],
    "zero3_whole": [
        "training.distributed_strategy=deepspeed",
        "training.zero_stage=3",
        "training.zero3_init=false",
    ],
}


def theory_bytes(strategy: str, num_parameters: int, ranks: int) -> float:
    p, n = num_parameters, ranks
    weights, grads, moments = 4 * p, 4 * p, 8 * p
    if strategy in ("none", "ddp"):
        return weights + grads + moments
    if strategy == "zero1":
        return weights + grads + moments / n
    if strategy == "zero2":
        return weights + (grads + moments) / n
    return (weights + grads + moments) / n


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def worker(out_dir: str, steps: int, overrides: list[str]) -> None:
    """One rank: train a few steps and write this rank's memory figures."""
    import resource

    import torch

    from tandem.config import load_config
    from tandem.distributed.engine import build_engine
    from tandem.distributed.env import init_distributed, shutdown
    from tandem.trainer.batching import Sample
    from tandem.trainer.grpo import optimizer_step
    from tandem.trainer.rl_steps import scatter_share
    from tandem.trainer.run import load_policy

    cfg = load_config(
        None,
        [
            "training.device=cpu",
            "grpo.prompts_per_step=2",
            "sampling.num_generations=4",
            "training.micro_batch_size=2",
            "training.gradient_accumulation_steps=2",
            "training.gradient_checkpointing=true",
            *overrides,
        ],
    )
    env = init_distributed(cfg.training.distributed_strategy, "cpu")
    baseline = rss_gb()
    _, model = load_policy(cfg, env, torch.device("cpu"))  # model.policy: embedded, float32
    num_parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # shards count whole
    loaded = rss_gb()
    engine = build_engine(model, cfg.training, env, torch.device("cpu"))
    built = rss_gb()
    g = torch.Generator().manual_seed(0)
    after_first = None
    for step in range(steps):
        samples = []
        if env.is_main:
            for group in range(2):
                prompt = torch.randint(100, 40000, (64,), generator=g).tolist()
                for _ in range(4):
                    samples.append(
                        Sample(
                            prompt,
                            torch.randint(100, 40000, (64,), generator=g).tolist(),
                            -torch.rand(64, generator=g) - 1,
                            -torch.rand(64, generator=g) - 1,
                            float(torch.randn(1, generator=g)),
                            0,
                            group,
                        )
                    )
        share = scatter_share(env, samples if env.is_main else None, cfg)
        optimizer_step(engine, share, cfg, torch.device("cpu"), env)
        if step == 0:
            after_first = rss_gb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6 * 1.024
    result = {
        "rank": env.rank,
        "world_size": env.world_size,
        "num_parameters": num_parameters,
        "model_state_gb": after_first - baseline,
        "after_load_gb": loaded - baseline,
        "after_engine_gb": built - baseline,
        "peak_gb": peak - baseline,
    }
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(result))
    shutdown(env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(strategy: str, ranks: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        args = [__file__, "--worker", out, "--steps", str(steps), *STRATEGIES[strategy]]
        if strategy == "none":
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
            cmd += [f"--master-port={free_port()}", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_out_arguments(parser, "distributed_memory")
    args, rest = parser.parse_known_args()
    args.out = results_file(args, "distributed_memory")
    if args.worker:
        worker(args.worker, args.steps, rest)
        return
    table = []
    for strategy in args.strategies.split(","):
        ranks = 1 if strategy == "none" else args.ranks
        rows = run(strategy, ranks, args.steps)
        p = rows[0]["num_parameters"]
        row = {
            "strategy": strategy,
            "ranks": ranks,
            "after_load_gb_by_rank": [r["after_load_gb"] for r in rows],
            "after_engine_gb_per_rank": max(r["after_engine_gb"] for r in rows),
            "model_state_gb_per_rank": max(r["model_state_gb"] for r in rows),
            "peak_gb_per_rank": max(r["peak_gb"] for r in rows),
            "theory_gb_per_rank": theory_bytes(strategy, p, ranks) / 1e9,
            "num_parameters": p,
        }
        table.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
