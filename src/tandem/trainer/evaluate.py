"""`tandem eval`: answer and format accuracy of a model on GSM8K-format questions, batched.

tandem eval --model runs/grpo_tiny/final --dataset synthetic --split test --num-examples 200
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tandem.config import DEFAULT_SYSTEM_PROMPT, RewardSpec
from tandem.data.gsm8k import load_examples
from tandem.models.loading import load_causal_lm, load_tokenizer
from tandem.rewards.gsm8k import answer_reward, format_reward
from tandem.rewards.registry import RewardSet
from tandem.sampler.rollout import Rollout
from tandem.trainer.runtime import resolve_device


def resolve_eval_model(spec: str) -> str:
    """A checkpoints/step-N folder holds its weights in model/; anything else is a model spec."""
    path = Path(spec)
    if (path / "model" / "config.json").is_file():
        return str(path / "model")
    return spec


def prompt_settings(model: str, config: str | None = None) -> dict:
    """The prompt a model was trained with: from `config`, else from the config.yaml of the run
    that `model` belongs to (RUN/final or RUN/checkpoints/step-N), else the built-in defaults."""
    from tandem.config import DataConfig, SamplingConfig, load_config

    path = Path(config) if config else None
    if path is None:
        for parent in list(Path(model).parents)[:3]:
            if (parent / "config.yaml").is_file() and (parent / "metrics.jsonl").is_file():
                path = parent / "config.yaml"
                break
    if path is None:
        data, sampling = DataConfig(), SamplingConfig()
    else:
        cfg = load_config(path)
        data, sampling = cfg.data, cfg.sampling
    return {
        "system_prompt": data.system_prompt,
        "num_shots": data.num_shots,
        "prefill": data.prefill,
        "difficulty": data.difficulty,
        "max_new_tokens": sampling.max_new_tokens,
    }


def evaluate(
    *,
    model: str = "embedded",
    dataset: str = "synthetic",
    split: str = "test",
    num_examples: int = 200,
    difficulty: int = 1,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    num_shots: int = 1,
    prefill: str = "<think>",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    num_samples: int = 1,
    batch_size: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    device: str = "auto",
) -> dict:
    """Accuracy summary plus every completion; greedy when temperature == 0."""
    if temperature == 0 and num_samples > 1:
        raise ValueError("--num-samples > 1 needs sampling: set --temperature > 0")
    torch.manual_seed(seed)
    spec = resolve_eval_model(model)
    tokenizer = load_tokenizer(spec)
    policy = load_causal_lm(spec, dtype=dtype, trainable=False, device=resolve_device(device))
    examples = load_examples(dataset, split, num_examples, seed, difficulty=difficulty)
    rollout = Rollout(
        policy=policy,
        reference=None,
        tokenizer=tokenizer,
        rewards=RewardSet.from_specs([RewardSpec("answer"), RewardSpec("format")]),
        system_prompt=system_prompt,
        num_shots=num_shots,
        prefill=prefill,
        num_generations=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        scale_rewards="none",
        generator=torch.Generator().manual_seed(seed),
    )
    start = time.perf_counter()
    groups = rollout.run(examples, policy_version=0)
    seconds = time.perf_counter() - start
    rows = []
    for example, group in zip(examples, groups):
        for c in group.completions:
            response = prefill + c.text
            rows.append(
                {
                    "prompt_id": example.prompt_id,
                    "question": example.question,
                    "answer": example.answer,
                    "response": response,
                    "correct": answer_reward(response, example.answer) > 0,
                    "formatted": format_reward(response) > 0,
                    "num_tokens": len(c.generated_token_ids),
                }
            )
    return {
        "model": model,
        "dataset": dataset,
        "split": split,
        "num_examples": len(examples),
        "num_samples": num_samples,
        "temperature": temperature,
        "answer_accuracy": statistics.fmean(r["correct"] for r in rows),
        "format_accuracy": statistics.fmean(r["formatted"] for r in rows),
        "completion_length_mean": statistics.fmean(r["num_tokens"] for r in rows),
        "seconds": seconds,
        "rows": rows,
    }
