"""Generation engines side by side on the embedded model: tokens/s of our sampler, vLLM
(`sampling.backend: vllm`) and HF `generate` on the same shape, fp32 and bf16; the seconds to
load one weight version into each; and how far each engine's sampled log-probs are from the
trainer's (fp32 master weights, the same tokens).

    python benchmarks/vllm_generation.py                       # 8 prompts x 4 x 128 tokens, 3 repeats
    python benchmarks/vllm_generation.py --update-results      # the figures the README quotes

Each dtype runs in a child process of its own (vLLM's in-process engine pins the threads of the
process that starts it), all three engines in it alternating round by round, on the same cores
(vLLM bound to all the cores this process may use, torch on as many threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import add_out_arguments, results_file  # noqa: E402

PROMPTS, GROUP = 8, 4


def gap(sampled: list[list[float]], trainer: list[torch.Tensor]) -> dict:
    """Mean |logp_trainer - logp_sampler| and the k3 KL(sampler || trainer) over all tokens."""
    s = torch.tensor([x for row in sampled for x in row], dtype=torch.float64)
    t = torch.cat(trainer).double()
    r = t - s
    return {
        "abs_diff_mean": float(r.abs().mean()),
        "abs_diff_max": float(r.abs().max()),
        "kl_k3": float((r.exp() - r - 1).mean()),
        "tokens": int(r.numel()),
    }


def child(dtype: str, new_tokens: int, repeats: int, threads: int) -> dict:
    if threads:  # the last `threads` cores, as a sampler beside a trainer gets them
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[-threads:])
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from vllm import SamplingParams

    from tandem.config import VLLMSpec
    from tandem.models.forward import pack_rows, packed_logprobs
    from tandem.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from tandem.sampler.generation import generate_groups
    from tandem.sampler.vllm_engine import VLLMEngine

    path = resolve_model_path("embedded")
    start = time.perf_counter()
    engine = VLLMEngine(
        path,
        spec=VLLMSpec(cpu_threads_bind="auto"),
        dtype=dtype,
        device=torch.device("cpu"),
        seed=0,
        max_new_tokens=new_tokens,
        batch_size=PROMPTS * GROUP,
        num_threads=threads,
    )
    vllm_start = time.perf_counter() - start
    tokenizer = load_tokenizer("embedded")
    model = load_causal_lm("embedded", dtype=dtype, trainable=False, device=torch.device("cpu"))
    trainer = load_causal_lm("embedded", dtype="float32", trainable=False, device=torch.device("cpu"))
    prompts = [
        tokenizer(f"Question {i}: what is {7 * i} plus {3 * i}? Think step by step.")["input_ids"]
        for i in range(PROMPTS)
    ]

    def ours(seed):
        out = generate_groups(
            model,
            prompts,
            num_generations=GROUP,
            max_new_tokens=new_tokens,
            eos_token_ids=[-1],
            pad_token_id=tokenizer.pad_token_id or 0,
            batch_size=PROMPTS * GROUP,
            generator=torch.Generator().manual_seed(seed),
        )
        return out.token_ids, out.logprobs

    def vllm(seed):
        params = SamplingParams(
            n=GROUP, max_tokens=new_tokens, ignore_eos=True, logprobs=0, seed=seed, detokenize=False
        )
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ids = [list(o.token_ids) for r in outs for o in r.outputs]
        lps = [[s[t].logprob for s, t in zip(o.logprobs, o.token_ids)] for r in outs for o in r.outputs]
        return ids, lps

    def hf(seed):
        torch.manual_seed(seed)
        batch = tokenizer.pad(
            {"input_ids": [p for p in prompts for _ in range(GROUP)]},
            return_tensors="pt",
            padding_side="left",
        )
        out = model.generate(
            **batch,
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            top_k=0,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        return out[:, batch["input_ids"].shape[1] :].tolist(), None

    engines = {"tandem": ours, "vllm": vllm, "hf_generate": hf}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    gaps = {}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, run in engines.items():
            begin = time.perf_counter()
            ids, lps = run(repeat)
            if repeat:
                rates[name].append(sum(map(len, ids)) / (time.perf_counter() - begin))
            if repeat == 1 and lps is not None:
                rows = [(prompts[p], ids[p * GROUP : (p + 1) * GROUP]) for p in range(PROMPTS)]
                with torch.inference_mode():
                    reference = packed_logprobs(trainer, pack_rows(rows))
                gaps[name] = gap(lps, [reference[i, : len(c)] for i, c in enumerate(ids)])
    # one weight version: the trainer's fp32 tensors into each engine's copy of the policy
    load = {"tandem": [], "vllm": []}
    for _ in range(3):
        begin = time.perf_counter()
        with torch.no_grad():
            for p, q in zip(model.parameters(), trainer.parameters()):
                p.copy_(q)
        load["tandem"].append(time.perf_counter() - begin)
        load["vllm"].append(engine.load_weights(trainer))
    engine.close()
    return {
        "threads": threads,
        "vllm_engine_start_seconds": vllm_start,
        "tokens_per_second": {name: statistics.median(r) for name, r in rates.items()},
        "vllm_over_tandem": statistics.median(rates["vllm"]) / statistics.median(rates["tandem"]),
        "weight_load_seconds": {name: statistics.median(v) for name, v in load.items()},
        "logprob_gap_to_trainer_fp32": gaps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--threads", type=int, default=0, help="cores per engine (0: all; 1: a sampler's share here)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_out_arguments(parser, "vllm_generation")
    args = parser.parse_args()
    name = "vllm_generation" if not args.threads else f"vllm_generation_{args.threads}thread"
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.new_tokens, args.repeats, args.threads)))
        return
    results = {
        "model": "embedded SmolLM2-135M-Instruct",
        "shape": f"{PROMPTS} prompts x {GROUP} completions x {args.new_tokens} new tokens (no eos)",
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
        + ("cuda" if torch.cuda.is_available() else "cpu"),
    }
    for dtype in args.dtypes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            dtype,
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
            "--threads",
            str(args.threads),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"{dtype} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results[dtype] = json.loads(line.removeprefix("RESULT "))
        print(dtype, json.dumps(results[dtype], indent=1))
    out = results_file(args, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {out}")


if __name__ == "__main__":
    main()
