"""TRL's GRPOTrainer on the setting of benchmarks/grpo_step.py, for a side-by-side measurement.

Runs in a separate virtual environment that has TRL (tandem does not depend on it):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl
    .venv/bin/python benchmarks/grpo_step.py --trl-python .venv-trl/bin/python

grpo_step.py calls it as `PYTHON trl_grpo_step.py MODEL_DIR OUT.json --steps N`. Setting: the same
model folder (the embedded SmolLM2-135M-Instruct converted by tandem), fp32 on the CPU, 8 prompts x
4 completions per optimizer step (per-device batch 8 x accumulation 4), 128 new tokens, temperature
1, beta (KL) 0.04, lr 1e-6, gradient checkpointing, the tag format in the system prompt only, the
seed's answer and format rewards (tandem's own functions, imported from src/), the same synthetic
problems. Writes per-step seconds and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step inside <think> </think>, "
    "then write only the final number inside <answer> </answer>."
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's bf16=True), fp32 weights")
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tandem.data.arithmetic import make_examples
    from tandem.rewards.gsm8k import answer_reward, format_reward

    torch.manual_seed(0)
    examples = make_examples(200, seed=0, split="train", difficulty=1)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": e.question},
                ],
                "answer": e.answer,
            }
            for e in examples
        ]
    )

    def text(completion) -> str:
        return completion[-1]["content"] if isinstance(completion, list) else completion

    def answer(completions, answer, **kwargs):
        return [answer_reward(text(c), a) for c, a in zip(completions, answer)]

    def fmt(completions, **kwargs):
        return [format_reward(text(c)) for c in completions]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.starts[-1])

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_run"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,  # 32 completions = 8 prompts x 4 per optimizer step
        num_generations=4,
        max_completion_length=128,
        temperature=1.0,
        beta=0.04,
        learning_rate=1e-6,
        gradient_checkpointing=True,
        bf16=args.bf16,
        fp16=False,
        use_cpu=True,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[answer, fmt],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    timed = timer.seconds[1:] if len(timer.seconds) > 1 else timer.seconds
    result = {
        "trl_version": trl.__version__,
        "steps": len(timer.seconds),
        "step_seconds": statistics.median(timed),
        "step_seconds_all": timer.seconds,
        "wall_seconds": wall,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "log_history": trainer.state.log_history,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "log_history"}))


if __name__ == "__main__":
    main()
