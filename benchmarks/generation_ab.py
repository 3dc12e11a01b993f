"""Generation throughput of this tree's sampler against an earlier commit's, side by side in one
process on the embedded model (alternating runs, so both see the same machine state).

    python benchmarks/generation_ab.py --base a86c28f            # fp32 and bf16, 8 prompts x 4 x 64 tokens

The README quotes it for the sampler's fp32 output projection (bf16 rollouts).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import add_out_arguments, results_file  # noqa: E402
from tandem.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from tandem.sampler import generation as current  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load_base(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:src/tandem/sampler/generation.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "base_generation.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_generation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_generation"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_out_arguments(parser, "generation_ab")
    args = parser.parse_args()
    torch.set_num_threads(2)
    base = load_base(args.base)
    tokenizer = load_tokenizer("embedded")
    prompts = [
        tokenizer(f"Question {i}: what is {7 * i} plus {3 * i}? Think step by step.")["input_ids"]
        for i in range(8)
    ]
    results = {"base": args.base, "prompts": 8, "completions_per_prompt": 4, "new_tokens": args.new_tokens}
    for dtype in ("float32", "bfloat16"):
        model = load_causal_lm("embedded", dtype=dtype, trainable=False, device=torch.device("cpu"))
        rates: dict[str, list[float]] = {"base": [], "current": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, module in (("base", base), ("current", current)):
                start = time.perf_counter()
                out = module.generate_groups(
                    model,
                    prompts,
                    num_generations=4,
                    max_new_tokens=args.new_tokens,
                    eos_token_ids=[-1],  # never: every completion is new_tokens long
                    pad_token_id=tokenizer.pad_token_id or 0,
                    batch_size=32,
                    generator=torch.Generator().manual_seed(repeat),
                )
                if repeat:
                    rates[name].append(sum(map(len, out.token_ids)) / (time.perf_counter() - start))
        results[dtype] = {
            "base_tokens_per_second": statistics.median(rates["base"]),
            "current_tokens_per_second": statistics.median(rates["current"]),
            "ratio": statistics.median(rates["current"]) / statistics.median(rates["base"]),
        }
        print(dtype, json.dumps(results[dtype]))
    out = results_file(args, "generation_ab")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {out}")


if __name__ == "__main__":
    main()
