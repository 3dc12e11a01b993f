"""`tandem eval`: answer and format accuracy of a model on GSM8K-format questions, batched.

tandem eval --model runs/grpo_tiny/final --dataset synthetic --split test --num-examples 200
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.config import ConfigError, DataConfig, RewardSpec
from tandem.data.prompt_sets import load_examples
from tandem.data.prompts import prompt_style
from tandem.distributed.runtime import resolve_device, use_device
from tandem.models.loading import check_model_spec, load_causal_lm, load_tokenizer
from tandem.preflight import check_dataset, check_device
from tandem.rewards.registry import RewardSet
from tandem.sampler.episodes import episode_fields
from tandem.sampler.rollout import Rollout, build_agent

log = logging.getLogger(__name__)

# the generation settings a run's config decides (data.* and sampling.max_new_tokens)
SETTINGS = ("system_prompt", "num_shots", "prefill", "difficulty", "max_new_tokens")


def resolve_eval_model(spec: str) -> str:
    """A checkpoints/step-N folder holds its weights in model/; anything else is a model spec."""
    path = Path(spec)
    if (path / "model" / "config.json").is_file():
        return str(path / "model")
    return spec


def run_config_path(model: str, config: str | None = None) -> Path | None:
    """`config`, else the config.yaml of the run that `model` belongs to (RUN/final or
    RUN/checkpoints/step-N), else None."""
    if config:
        return Path(config)
    for parent in list(Path(model).parents)[:3]:
        if (parent / "config.yaml").is_file() and (parent / "metrics.jsonl").is_file():
            return parent / "config.yaml"
    return None


def eval_settings(model: str, config: str | None = None, **given) -> tuple[dict, dict[str, str]]:
    """(settings, where each came from): a value in `given` that is not None wins ("flag"), then
    the run's config.yaml (or `config`; its path), then the built-in default ("default")."""
    from tandem.config import DataConfig, SamplingConfig, load_config

    path = run_config_path(model, config)
    if path is None:
        data, sampling, origin = DataConfig(), SamplingConfig(), "default"
    else:
        cfg = load_config(path)
        data, sampling, origin = cfg.data, cfg.sampling, str(path)
    values = {
        "system_prompt": data.system_prompt,
        "num_shots": data.num_shots,
        "prefill": data.prefill,
        "difficulty": data.difficulty,
        "max_new_tokens": sampling.max_new_tokens,
    }
    sources = dict.fromkeys(values, origin)
    for key in SETTINGS:
        if given.get(key) is not None:
            values[key], sources[key] = given[key], "flag"
    return values, sources


def describe_settings(values: dict, sources: dict[str, str]) -> str:
    """One line: `max_new_tokens=256 (runs/x/config.yaml), prefill='<think>' (default), ...`."""
    parts = []
    for key in SETTINGS:
        value = values[key]
        shown = repr(value if len(str(value)) <= 40 else str(value)[:37] + "...")
        parts.append(f"{key}={shown} ({sources[key]})")
    return ", ".join(parts)


def evaluate(
    *,
    model: str = "embedded",
    dataset: str = "synthetic",
    split: str = "test",
    num_examples: int = 200,
    difficulty: int | None = None,
    system_prompt: str | None = None,
    num_shots: int | None = None,
    prefill: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    num_samples: int = 1,
    batch_size: int = 32,
    dtype: str = "float32",
    seed: int = 0,
    device: str = "auto",
    config: str | None = None,
    progress: bool = True,
) -> dict:
    """Accuracy summary plus every completion; greedy when temperature == 0.

    The generation settings left None come from the run's config.yaml (or `config`), else the
    defaults; the log and the summary's `settings` say which value came from where. Model, data
    and device are checked before anything loads (a typo fails at once, never at the hub)."""
    if temperature == 0 and num_samples > 1:
        raise ValueError("--num-samples > 1 needs sampling: set --temperature > 0")
    check_device(device, "--device")
    spec = resolve_eval_model(model)
    check_model_spec(spec, "--model")
    check_dataset(dataset, "--dataset", use="prompts", split=split, split_key="--split")
    given = dict(
        system_prompt=system_prompt,
        num_shots=num_shots,
        prefill=prefill,
        difficulty=difficulty,
        max_new_tokens=max_new_tokens,
    )
    settings, sources = eval_settings(model, config, **given)
    # the run's own worked examples and, for an agent run, its tools: the model answers as it trained
    run_path = run_config_path(model, config)
    run_cfg = None
    if run_path is not None:
        from tandem.config import load_config

        run_cfg = load_config(run_path)
    try:
        examples = load_examples(dataset, split, num_examples, seed, difficulty=settings["difficulty"])
        style = DataConfig(
            system_prompt=settings["system_prompt"],
            num_shots=settings["num_shots"],
            prefill=settings["prefill"],
            shots=run_cfg.data.shots if run_cfg is not None else None,
        )
        question_style = prompt_style(style, from_question=True)
        row_style = prompt_style(style, from_question=False)
    except ValueError as err:  # a bad row or an empty file: named, not a traceback
        raise ConfigError(f"`--dataset` {dataset}: {err}") from None
    # what an unset (null) setting means for these rows: the math task's, or nothing for own prompts
    used = question_style if examples[0].prompt is None else row_style
    resolved = {"system_prompt": used.system_prompt, "num_shots": len(used.shots), "prefill": used.prefill}
    for key, value in resolved.items():
        if settings[key] is None:
            settings[key] = value
    log.info("generation settings: %s", describe_settings(settings, sources))

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(spec)
    where = resolve_device(device)
    use_device(where)
    policy = load_causal_lm(spec, dtype=dtype, trainable=False, device=where)
    rewards = RewardSet.from_specs([RewardSpec("answer"), RewardSpec("format")])
    agent = None
    if run_cfg is not None and run_cfg.agent.enabled:
        agent = build_agent(run_cfg, tokenizer, rewards)
        log.info(
            "episodes with the run's agent settings: tools %s, environment %s, at most %d turns",
            run_cfg.agent.tools,
            run_cfg.agent.environment,
            run_cfg.agent.max_turns,
        )
    rollout = Rollout(
        policy=policy,
        reference=None,
        tokenizer=tokenizer,
        rewards=rewards,
        agent=agent,
        question_style=question_style,
        row_style=row_style,
        num_generations=num_samples,
        max_new_tokens=settings["max_new_tokens"],
        temperature=temperature,
        batch_size=batch_size,
        scale_rewards="none",
        generator=torch.Generator().manual_seed(seed),
    )
    start = time.perf_counter()
    try:
        groups = _generate(rollout, examples, batch_size, num_samples, progress=progress)
    finally:
        if agent is not None:
            agent.close()
    seconds = time.perf_counter() - start
    rows = _rows(examples, groups, rollout)
    episodes = episode_fields(groups)  # agent runs: turns and tool calls per episode
    return {
        "model": model,
        "dataset": dataset,
        "split": split,
        "num_examples": len(examples),
        "num_samples": num_samples,
        "temperature": temperature,
        "settings": {key: {"value": settings[key], "from": sources[key]} for key in SETTINGS},
        "answer_accuracy": statistics.fmean(r["correct"] for r in rows),
        "format_accuracy": statistics.fmean(r["formatted"] for r in rows),
        "completion_length_mean": statistics.fmean(r["num_tokens"] for r in rows),
        **{key: episodes[key] for key in ("turns_mean", "tool_calls_mean", "tool_errors") if key in episodes},
        "seconds": seconds,
        "rows": rows,
    }


def _generate(rollout: Rollout, examples: list, batch_size: int, num_samples: int, *, progress: bool) -> list:
    """The groups of every example, one generation batch at a time under a progress bar (stderr).
    The batches are the ones generate_groups would make of the whole list, so the completions (and
    a sampled run's random stream) are the same as in one call."""
    prompts_per_batch = max(1, batch_size // num_samples)
    groups = []
    with tqdm(
        total=len(examples),
        desc="eval",
        unit="question",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not progress,
    ) as bar:
        for start in range(0, len(examples), prompts_per_batch):
            batch = examples[start : start + prompts_per_batch]
            groups += rollout.run(batch, policy_version=0)
            bar.update(len(batch))
    return groups


def _rows(examples: list, groups: list, rollout: Rollout) -> list[dict]:
    rows = []
    for example, group in zip(examples, groups):
        for c in group.completions:
            response = rollout.style(example).prefill + c.text
            rows.append(
                {
                    "prompt_id": example.prompt_id,
                    "question": example.question,
                    "answer": example.answer,
                    "response": response,
                    # the rollout scored prefill + text with the answer and format rewards
                    "correct": (c.reward_info["answer"] or 0.0) > 0,  # None: the row has no gold
                    "formatted": c.reward_info["format"] > 0,
                    "num_tokens": len(c.generated_token_ids),
                }
            )
    return rows
