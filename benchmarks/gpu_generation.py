"""Where a GPU decode step's time goes: tandem's sampler against transformers' `generate` on the
same model, side by side in one process, and both against the GPU's own kernel time.

    python benchmarks/gpu_generation.py --out gpu_generation.json     # on a machine with CUDA

The model is SmolLM2-135M's shape (30 layers, 576 wide, 49,152-token vocabulary) with random
weights built in code, so nothing needs to travel or download; every completion runs the full
`--new-tokens` (no eos is sampled from random weights often enough to matter, and `generate` is held
to the same length with min_new_tokens). For each batch (rows = prompts x completions) it reports
tokens/s of both, and for tandem the decode step's wall time against the sum of its CUDA kernels'
time (torch.profiler): the ratio says how far a step is from what the GPU itself needs, i.e. how
much is Python and kernel-launch overhead that CUDA graphs (vLLM) would remove.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import add_out_arguments, results_file  # noqa: E402
from tandem.sampler.generation import generate_groups  # noqa: E402


def smollm2_shaped(dtype: torch.dtype, device: str, layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up, the device drained around each."""
    fn()
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def kernel_seconds(fn) -> float:
    """Seconds the GPU spent in kernels during one call (the sum of their device times)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    from torch.autograd import DeviceType

    # the device's own events (kernels, copies), not the host ops that launched them (counted twice)
    return (
        sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA) / 1e6
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", default="32,128", help="completions per forward (prompts x 8)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: checks this script
    parser.add_argument("--layers", type=int, default=30, help=argparse.SUPPRESS)
    add_out_arguments(parser, "gpu_generation")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_generation needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    model = smollm2_shaped(dtype, args.device, args.layers)
    group = 8
    rows_out = {}
    for rows in (int(r) for r in args.rows.split(",")):
        torch.manual_seed(1)
        prompts = torch.randint(3, 49152, (rows // group, args.prompt_tokens)).tolist()
        tokens = rows * args.new_tokens
        generator = torch.Generator().manual_seed(0)

        def ours(prompts=prompts, rows=rows, generator=generator):
            out = generate_groups(
                model,
                prompts,
                num_generations=group,
                max_new_tokens=args.new_tokens,
                eos_token_ids=[-1],  # never sampled: every completion runs the full length
                pad_token_id=2,
                batch_size=rows,
                generator=generator,
            )
            assert sum(map(len, out.token_ids)) == rows * args.new_tokens

        batch = torch.tensor(prompts, device=args.device).repeat_interleave(group, dim=0)

        def theirs(batch=batch):
            out = model.generate(
                input_ids=batch,
                attention_mask=torch.ones_like(batch),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=2,
            )
            assert out.shape[1] == batch.shape[1] + args.new_tokens

        ours_s = timed(ours, args.repeats)
        theirs_s = timed(theirs, args.repeats)
        kernels_s = kernel_seconds(ours)
        rows_out[str(rows)] = {
            "tandem_tokens_per_s": round(tokens / ours_s, 1),
            "hf_generate_tokens_per_s": round(tokens / theirs_s, 1),
            "ratio_tandem_to_hf": round(theirs_s / ours_s, 3),
            "tandem_ms_per_decode_step": round(1000 * ours_s / args.new_tokens, 2),
            "kernel_ms_per_decode_step": round(1000 * kernels_s / args.new_tokens, 2),
            "wall_over_kernel_time": round(ours_s / kernels_s, 2) if kernels_s else None,
        }
        print(f"rows {rows}: {json.dumps(rows_out[str(rows)])}", flush=True)
    results = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (a check of this script)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "model": "SmolLM2-135M shape, random weights",
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "completions_per_prompt": group,
        "rows": rows_out,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = results_file(args, "gpu_generation")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
