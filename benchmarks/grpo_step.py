"""GRPO step time and peak memory on the embedded default, in TRL's benchmark setting.

  .venv/bin/python benchmarks/grpo_step.py [--steps 5] [--skip-anchor] [--trl-python .venv-trl/bin/python]

Setting (as the TRL 1.16 GRPOTrainer peer run): SmolLM2-135M-Instruct fp32, 8 prompts x 4
completions, 128 new tokens, the tag format in the system prompt only (no example, no prefill),
kl_coef 0.04 (a reference forward every step), lr 1e-6, gradient checkpointing. Our loop runs in a
child process so its peak RSS is its own. In the same sitting, a plain `transformers.generate`
(batch 32, 128 tokens, fp32) measures how fast this machine is against the one TRL was measured on
(137 tok/s there), so the TRL figures can be compared fairly. With --trl-python (a venv that has
TRL, see benchmarks/trl_grpo_step.py) TRL's GRPOTrainer runs the same setting right after ours, in
the same sitting, and the ratios are taken between the two measurements.
Writes benchmarks/results/runs/grpo_step-<time>.json (`--update-results`: the tracked
benchmarks/results/grpo_step.json).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py

HERE = Path(__file__).resolve().parent
TRL = {
    "step_seconds": 116.0,
    "peak_rss_gb": 10.1,
    "generate": 29.5,
    "reference": 16.6,
    "policy_forward": 19.5,
    "backward_optimizer": 50.8,
    "hf_generate_tok_s_b32": 137.0,
}

OVERRIDES = [
    "pipeline.mode=colocated",
    "grpo.prompts_per_step=8",
    "sampling.num_generations=4",
    "data.num_shots=0",
    "data.prefill=''",
    "grpo.skip_zero_variance_groups=false",
    "training.learning_rate=1e-6",
    "training.warmup_steps=0",
    "training.save_steps=0",
    "training.sample_log_steps=0",
    "grpo.kl_coef=0.04",
]


def run_ours(steps: int, out: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "grpo",
        str(HERE.parent / "configs" / "grpo_tiny.yaml"),
        "experiment_name=bench",
        f"output_dir={out}",
        f"training.max_steps={steps}",
        *OVERRIDES,
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    rows = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] if len(rows) > 1 else rows  # the first step pays one-off warm-up costs

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    return {
        "steps": len(rows),
        "wall_seconds_incl_load": wall,
        "peak_rss_gb": peak_gb,
        "step_seconds": median("step_seconds"),
        "generate": median("time_generate"),
        "reference": median("time_reference"),
        "train_forward_backward": median("time_train"),
        "optimizer": median("time_optimizer"),
        "tokens_generated": median("tokens_generated"),
        "generate_tokens_per_second": median("generate_tokens_per_second"),
        "tokens_per_second": median("tokens_generated") / median("step_seconds"),
        "rows": rows,
    }


ANCHOR = """
import time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tandem.models.loading import resolve_model_path
path = resolve_model_path("embedded")
tok = AutoTokenizer.from_pretrained(path); tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
msgs = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"}]
enc = tok([tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)] * 32, return_tensors="pt")
kw = dict(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=128, min_new_tokens=128, pad_token_id=tok.pad_token_id)
with torch.inference_mode():
    model.generate(**enc, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    t = time.perf_counter(); model.generate(**enc, **kw); dt = time.perf_counter() - t
print(32 * 128 / dt)
"""


def run_trl(python: str, steps: int, tmp: Path, bf16: bool = False) -> dict:
    """TRL's GRPOTrainer on the same setting, in its own venv (benchmarks/trl_grpo_step.py)."""
    from tandem.models.loading import resolve_model_path

    out = tmp / "trl.json"
    cmd = [
        python,
        str(HERE / "trl_grpo_step.py"),
        resolve_model_path("embedded"),
        str(out),
        "--steps",
        str(steps),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    result.pop("log_history", None)
    return result


def run_anchor() -> float:
    out = subprocess.run([sys.executable, "-c", ANCHOR], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--skip-anchor", action="store_true", help="skip the HF generate machine-speed anchor"
    )
    add_out_arguments(parser, "grpo_step")
    parser.add_argument("--trl-python", help="python of a venv with TRL: measure TRL side by side")
    parser.add_argument(
        "--trl-bf16", action="store_true", help="TRL with bf16=True (compare with our bf16 run)"
    )
    parser.add_argument("overrides", nargs="*", help="more key=value settings for our run")
    args = parser.parse_args()
    args.out = results_file(args, "grpo_step")

    with tempfile.TemporaryDirectory() as tmp:
        ours = run_ours(args.steps, Path(tmp), args.overrides)
        trl = run_trl(args.trl_python, args.steps, Path(tmp), args.trl_bf16) if args.trl_python else None
    result = {"setting": OVERRIDES + args.overrides, "ours": ours, "trl_1_16_peer": TRL}
    if trl is not None:
        result["trl_measured_here"] = trl
        result["measured_side_by_side"] = {
            "step_time_vs_trl": ours["step_seconds"] / trl["step_seconds"],
            "peak_rss_vs_trl": ours["peak_rss_gb"] / trl["peak_rss_gb"],
        }
    speed = 1.0
    if not args.skip_anchor:
        anchor = run_anchor()
        speed = anchor / TRL["hf_generate_tok_s_b32"]
        result["hf_generate_tok_s_b32_here"] = anchor
        result["machine_speed_vs_trl_machine"] = speed
    result["ratios"] = {
        "step_time_vs_trl": ours["step_seconds"] / TRL["step_seconds"],
        "step_time_vs_trl_machine_adjusted": ours["step_seconds"] * speed / TRL["step_seconds"],
        "peak_rss_vs_trl": ours["peak_rss_gb"] / TRL["peak_rss_gb"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in ours.items() if k != "rows"}
    print(
        json.dumps(
            {"ours": summary, **{k: v for k, v in result.items() if k not in ("ours", "setting")}}, indent=1
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
