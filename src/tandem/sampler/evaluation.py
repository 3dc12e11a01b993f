"""Held-out evaluation during a GRPO/PPO run (`eval.*`): the policy version at hand answers the eval
prompts (greedy by default, k samples for pass@k / mean@k) and the run's own rewards score them.

The colocated trainer calls it between steps; in a decoupled run the sampler `eval.sampler_id` calls
it on the versions it loads and sends the figures to the trainer (transport's `eval` message), so
the trainer never stops to generate. Its random stream is its own: evaluating never changes what a
seeded run trains on.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from tandem.config import Config
from tandem.data.prompt_sets import load_examples
from tandem.sampler.episodes import episode_fields
from tandem.sampler.rollout import Rollout
from tandem.types import Group

EVAL_SEED_OFFSET = 7919  # the eval generator's seed is the run's plus this: never the training stream


def correct_reward_name(cfg: Config) -> str:
    """eval.correct_reward, else `answer` if the run has it, else the first reward."""
    names = [spec.resolved_name for spec in cfg.rewards]
    if cfg.eval.correct_reward is not None:
        return cfg.eval.correct_reward
    return "answer" if "answer" in names else names[0]


def eval_fields(groups: list[Group], correct: str, num_samples: int) -> dict:
    """The eval_* figures of scored groups (one per prompt, `num_samples` completions each):
    eval_accuracy (mean@k: completions whose `correct` reward is positive, over those it applies to),
    eval_pass_at_k (prompts with at least one such completion, over the prompts it applies to),
    eval_reward_mean (scored completions), eval_reward_<name> (each component where it applies),
    eval_completion_length, eval_num_examples, eval_num_samples. Null where nothing applies."""
    completions = [c for g in groups for c in g.completions]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    judged = [[c.reward_info.get(correct) for c in g.completions] for g in groups]
    applied = [[v for v in row if v is not None] for row in judged]
    fields = {
        "eval_accuracy": mean([float(v > 0) for row in applied for v in row]),
        "eval_pass_at_k": mean([float(any(v > 0 for v in row)) for row in applied if row]),
        "eval_reward_mean": mean([c.reward for c in completions if c.scored]),
        "eval_completion_length": mean([float(len(c.generated_token_ids)) for c in completions]),
        "eval_num_examples": len(groups),
        "eval_num_samples": num_samples,
    }
    names = sorted({name for c in completions for name in c.reward_info})
    for name in names:
        fields[f"eval_reward_{name}"] = mean(
            [c.reward_info[name] for c in completions if c.reward_info.get(name) is not None]
        )
    return fields


class Evaluator:
    """Evaluates `rollout`'s policy (or engine) on the eval set; `due(version)` says whether a version
    is one to evaluate (0, and every eval.steps-th)."""

    def __init__(self, cfg: Config, rollout: Rollout) -> None:
        ev, d = cfg.eval, cfg.data
        self.steps, self.num_samples = ev.steps, ev.num_samples
        self.correct = correct_reward_name(cfg)
        self.examples = load_examples(
            ev.dataset or d.dataset,
            ev.split,
            ev.num_examples,
            cfg.seed,
            difficulty=d.difficulty,
            prompt_column=d.prompt_column,
        )
        temperature = ev.temperature
        if temperature is None:
            temperature = 0.0 if ev.num_samples == 1 else cfg.sampling.temperature
        # the training rollout's policy, engine, tokenizer, rewards and prompt format; no reference
        # (no KL here), group-free advantages, an own random stream, no engine gap measure
        self.rollout = dataclasses.replace(
            rollout,
            reference=None,
            num_generations=ev.num_samples,
            temperature=temperature,
            max_new_tokens=ev.max_new_tokens or rollout.max_new_tokens,
            scale_rewards="none",
            generator=torch.Generator().manual_seed(cfg.seed + EVAL_SEED_OFFSET),
            engine_check_groups=0,
            timings=type(rollout.timings)(),
            _prompt_cache={},
        )
        self.done: set[int] = set()

    def due(self, version: int) -> bool:
        return self.steps > 0 and version not in self.done and version % self.steps == 0

    def run(self, version: int) -> dict:
        """The eval_* figures of the version the rollout holds now, plus eval_policy_version and
        eval_seconds."""
        start = time.perf_counter()
        prompts_per_batch = max(1, self.rollout.batch_size // self.num_samples)
        groups: list[Group] = []
        for first in range(0, len(self.examples), prompts_per_batch):
            groups += self.rollout.run(
                self.examples[first : first + prompts_per_batch], policy_version=version
            )
        self.done.add(version)
        fields = eval_fields(groups, self.correct, self.num_samples)
        # agent runs: how often the policy reaches for its tools on held-out prompts
        episodes = episode_fields(groups)
        fields.update({f"eval_{k}": episodes[k] for k in ("turns_mean", "tool_calls_mean") if k in episodes})
        fields["eval_policy_version"] = version
        fields["eval_seconds"] = time.perf_counter() - start
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}


def row_fields(evals: list[tuple[int, dict]]) -> dict:
    """A metrics row's share of evaluations (version, eval_* fields), oldest first: version 0's as
    eval_*_initial, the newest other one as they are (it names its eval_policy_version)."""
    row: dict = {}
    for version, fields in evals:
        if version == 0:
            row.update({f"{key}_initial": value for key, value in fields.items()})
        else:
            row.update(fields)
    return row
