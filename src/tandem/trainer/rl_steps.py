"""What the GRPO and PPO loops share: each rank's part of a batch of groups, and the record of a step.

`RankBatches` hides the process layout: rank 0 takes a batch of groups from the experience (this
process's rollout, or the samplers), turns it into samples, cuts it into optimizer batches and
scatters each by whole groups; every rank gets its own `Share` of each. `StepRecord` is rank 0's
bookkeeping around a step (the metrics row, the progress bar, sample dumps, the save cadence); the
loops call it on every rank and it does nothing where there is nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.config import Config, ConfigError, config_to_dict
from tandem.data.stream import prompt_stream
from tandem.distributed.batches import pad_micro_batches
from tandem.distributed.env import DistEnv, broadcast_after_waits, keep_alive, scatter_tensor_dicts
from tandem.distributed.runtime import peak_rss_gb
from tandem.sampler.dynamic import GroupFilter, max_extra_prompts
from tandem.sampler.episodes import episode_fields
from tandem.sampler.evaluation import Evaluator
from tandem.sampler.rollout import build_rollout
from tandem.trainer import run
from tandem.trainer.batching import (
    Sample,
    flatten_groups,
    loss_normalizer,
    samples_from_tensors,
    samples_to_tensors,
    split_across_ranks,
    split_micro_batches,
)
from tandem.trainer.experience import LocalExperience, RemoteExperience
from tandem.trainer.metrics import MetricsLogger, trl_aliases, write_samples
from tandem.transport.pacing import publishes_at
from tandem.types import Group

log = logging.getLogger(__name__)
LOCAL = DistEnv()
# a batch's generation and waiting are counted once, in its first step's row
PER_BATCH_TIMES = {"time_generate", "time_reference", "time_reward", "wait_seconds"}


@dataclass
class Share:
    """One rank's part of an optimizer batch (see scatter_share)."""

    samples: list[Sample]
    normalizer: float  # the whole batch's count the loss divides by (DESIGN.md section 6)
    num_micro: int  # micro-batches every rank runs this step
    padding: bool  # the samples only stand in (weight 0): this rank got no groups
    num_global: int  # sequences in the whole batch
    # the version of the weights the trainer held when the batch was taken; None when it had
    # updated them past the last version it published (no sampler holds those weights)
    weights_version: int | None = None

    @classmethod
    def local(cls, samples: list[Sample], cfg: Config) -> Share:
        """The whole batch on one process (no process group)."""
        return scatter_share(LOCAL, samples, cfg)

    def micro_batches(self, micro_batch_size: int) -> list[tuple[list[Sample], float]]:
        """(micro-batch, weight) pairs, num_micro of them (distributed.batches.pad_micro_batches)."""
        return pad_micro_batches(
            split_micro_batches(self.samples, micro_batch_size),
            self.num_micro,
            stand_in=self.samples,
            weight=0.0 if self.padding else 1.0,
        )

    def on_batch_weights(self, samples: list[Sample]) -> list[bool]:
        """Which samples the weights of the batch's start made: where the trainer and the sampler
        computed log-probs with the same weights, so that they can be compared."""
        return [s.policy_version == self.weights_version for s in samples]


def scatter_share(env: DistEnv, samples: list[Sample] | None, cfg: Config) -> Share:
    """Rank 0 splits one optimizer batch into whole groups per rank (balancing tokens) and sends
    each rank its samples, the batch's global loss normaliser and the micro-batch count every rank
    must run; every rank returns its own Share."""
    shares = None
    if env.is_main:
        assert samples is not None
        parts = split_across_ranks(samples, env.world_size)
        num_micro = max(len(split_micro_batches(p, cfg.training.micro_batch_size)) for p in parts)
        normalizer = loss_normalizer(samples, cfg.grpo.loss_agg) if samples else 0.0
        shares = []
        for part in parts:
            padding = not part and bool(samples)  # nothing for this rank: a zero-weighted stand-in
            t = samples_to_tensors(samples[:1] if padding else part)
            t["batch"] = torch.tensor(
                [normalizer, num_micro, float(padding), len(samples)], dtype=torch.float32
            )
            shares.append(t)
    t = scatter_tensor_dicts(env, shares)
    normalizer, num_micro, padding, num_global = t.pop("batch").tolist()
    return Share(samples_from_tensors(t), normalizer, int(num_micro), bool(padding), int(num_global))


def batch_steps(tc, num_samples: int, iterations: int, world_size: int) -> int:
    """Optimizer steps that one batch of `num_samples` sequences makes: `iterations` passes, each in
    optimizer batches of micro_batch_size x gradient_accumulation_steps x world_size (a batch whose
    groups were all skipped still makes one, empty, step per pass)."""
    per_step = tc.micro_batch_size * tc.gradient_accumulation_steps * world_size
    return iterations * max(1, math.ceil(num_samples / per_step))


@dataclass
class Batch:
    """One batch of groups as a rank sees it: the groups and their statistics (rank 0; empty on the
    others) and this rank's share of each optimizer batch, in order."""

    groups: list[Group] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    shares: list[Share] = field(default_factory=list)


class RankBatches:
    """Batches of groups for every rank. Rank 0 takes `prompts_per_step` groups from the experience,
    makes samples (flatten_groups: advantages rescaled per `scale_rewards`, zero-variance groups
    skipped or not, truncated completions masked out of the loss or not) and tells the experience how many optimizer steps they make (the samplers'
    pacing); then every rank receives its shares, with the version of the weights the batch was
    taken with (Share.weights_version)."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        experience,
        step: int,
        *,
        num_iterations: int,
        scale_rewards: str,
        adv_eps: float,
        skip_zero_variance: bool,
        mask_truncated: bool = False,
    ):
        self.cfg, self.env, self.experience, self.num_iterations = cfg, env, experience, num_iterations
        self.advantages = dict(
            scale_rewards=scale_rewards,
            adv_eps=adv_eps,
            skip_zero_variance=skip_zero_variance,
            mask_truncated=mask_truncated,
        )
        full_batch = cfg.prompts_per_step * cfg.sampling.num_generations
        self.steps_per_batch = batch_steps(cfg.training, full_batch, num_iterations, env.world_size)
        if experience is not None:
            experience.expect(step, 0, self.steps_per_batch)

    def next(self, step: int) -> Batch:
        batch, samples, version = Batch(), [], None
        if self.env.is_main:
            groups, stats = self.experience.next_groups(
                self.cfg.prompts_per_step, lambda: keep_alive(self.env)
            )
            batch = Batch(groups, {**summarize_groups(groups), **stats})
            samples = flatten_groups(groups, **self.advantages)
            steps = batch_steps(self.cfg.training, len(samples), self.num_iterations, self.env.world_size)
            self.experience.expect(step, steps, self.steps_per_batch)
            version = self.experience.weights_version()
        batch.shares = scatter_batch(self.env, samples, self.cfg, version)
        return batch


def scatter_batch(
    env: DistEnv, samples: list[Sample], cfg: Config, weights_version: int | None = None
) -> list[Share]:
    """This rank's share of each optimizer batch of one batch of samples: rank 0 cuts the batch into
    optimizer batches (the last may be short; an empty batch makes one empty step) and splits each by
    whole groups; the other ranks pass [] and receive. `weights_version` (rank 0's): see Share."""
    # every rank walks the same optimizer batches: rank 0 says how many sequences there are
    num_samples, weights_version = broadcast_after_waits(
        env, [len(samples), weights_version] if env.is_main else None
    )
    tc = cfg.training
    size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
    shares = [
        scatter_share(env, samples[first : first + size] if env.is_main else None, cfg)
        for first in range(0, max(num_samples, 1), size)
    ]
    for share in shares:
        share.weights_version = weights_version
    return shares


def open_experience(cfg: Config, env: DistEnv, engine, tokenizer, generator, device, state: dict | None):
    """Where groups come from, on rank 0 (None on the others): this process's own rollout
    (colocated) or the samplers (decoupled, whose RemoteExperience publishes the initial weights:
    every rank takes part in gathering them under ZeRO-3)."""
    if not env.is_main:
        with engine.gathered():
            return None
    if cfg.pipeline.mode == "colocated":
        if engine.shards_parameters:
            raise ConfigError(
                "`pipeline.mode` is colocated but ZeRO-3 shards the policy across ranks, so rank 0 "
                "cannot generate with it; use pipeline.mode=decoupled (or training.zero_stage=2)"
            )
        experience = local_experience(cfg, engine.module, tokenizer, generator, device)
    else:
        with engine.gathered():
            experience = RemoteExperience(cfg, cfg.run_dir, engine.module)
    if state is not None:
        experience.load_state_dict(state["experience"])
    elif isinstance(experience, LocalExperience):
        experience.evaluate_initial()
    return experience


def local_experience(cfg: Config, policy, tokenizer, generator, device) -> LocalExperience:
    stream = prompt_stream(cfg.data, cfg.prompts_per_step, seed=cfg.seed, stream_seed=cfg.seed)
    rollout = build_rollout(cfg, policy, tokenizer, generator, device)
    evaluator = Evaluator(cfg, rollout) if cfg.eval.steps > 0 else None
    # grpo.dynamic_sampling: the whole batch is this process's share
    group_filter = (
        GroupFilter(cfg.prompts_per_step, max_extra_prompts(cfg)) if cfg.grpo.dynamic_sampling else None
    )
    return LocalExperience(rollout, stream, policy, evaluator, group_filter)


def publish(experience, engine, cfg: Config, step: int, groups: list[Group]) -> dict:
    """After optimizer step `step`: rank 0 hands the new weights to the experience (published to the
    samplers on sync steps); returns the step's staleness and sync statistics (empty elsewhere)."""
    # ZeRO-3: every rank gathers the full parameters, so only for a step that publishes
    publishes = publishes_at(step, cfg.pipeline.sync_every, decoupled=cfg.pipeline.mode == "decoupled")
    with engine.gathered() if publishes else contextlib.nullcontext():
        if experience is None:
            return {}
        # versions between the weights that sampled this batch and the ones updated now
        staleness = statistics.fmean(experience.age(g) for g in groups)
        return {"staleness_mean": staleness, **experience.on_step(engine.module, step)}


class StepRecord:
    """Rank 0's record of an RL run: a metrics row and a progress-bar tick per step, sample dumps
    and checkpoints on their cadence. `postfix` picks a row's fields for the bar; `save(step)`
    writes a checkpoint (every rank calls it)."""

    def __init__(
        self, cfg: Config, env: DistEnv, step: int, *, desc: str, postfix, save: Callable[[int], None]
    ):
        self.cfg, self.env, self.tc, self.postfix, self.save = cfg, env, cfg.training, postfix, save
        reward_names = [spec.resolved_name for spec in cfg.rewards]
        self.logger = (
            MetricsLogger(
                cfg.run_dir,
                self.tc.report_to,
                resume_step=step,
                config=config_to_dict(cfg),
                aliases=lambda row: trl_aliases(row, reward_names),  # TensorBoard/W&B dashboards of TRL
            )
            if env.is_main
            else None
        )
        self.bar = tqdm(
            total=self.tc.max_steps, initial=step, desc=desc, dynamic_ncols=True, disable=not env.is_main
        )
        self.last_saved = self.at_step = step
        self.row_start = time.perf_counter()

    def start_batch(self) -> None:
        self.row_start = time.perf_counter()

    def step(self, step: int, batch: Batch, train_stats: dict, sync_stats: dict) -> None:
        """One optimizer step's row (rank 0)."""
        self.at_step = step
        if not self.env.is_main:
            return
        now = time.perf_counter()
        row = {
            "step": step,
            "policy_version": min(g.policy_version for g in batch.groups),
            "staleness_mean": sync_stats.pop("staleness_mean"),
            **batch.stats,
            **train_stats,
            **sync_stats,
            "step_seconds": now - self.row_start,
            "peak_rss_gb": peak_rss_gb(),
        }
        if self.env.world_size > 1:
            row["world_size"] = self.env.world_size
        batch.stats = {**batch.stats, **dict.fromkeys(PER_BATCH_TIMES & batch.stats.keys(), 0.0)}
        self.row_start = now
        evaluated = any(key.startswith("eval_") for key in row)  # a held-out evaluation is never skipped
        if step % self.tc.logging_steps == 0 or step == self.tc.max_steps or evaluated:
            self.logger.log(row)
        self.bar.update(1)
        self.bar.set_postfix(**self.postfix(row))

    def end_batch(self, step: int, batch: Batch) -> None:
        """Sample dumps (rank 0) and checkpoints (every rank) that fall due within this batch's steps."""
        every = self.tc.sample_log_steps
        if self.env.is_main and every and (step // every > (step - 1) // every or step == 1):
            write_samples(self.cfg.run_dir, step, sample_rows(batch.groups))
        if self.tc.save_steps and step // self.tc.save_steps > self.last_saved // self.tc.save_steps:
            self.save(step)
            self.last_saved = step

    @contextlib.contextmanager
    def steps(self, experience):
        """Around the loop: closes the bar and the log; a loop that stops early (an error, Ctrl-C)
        tells the samplers the trainer is going (they will see a restarted one)."""
        try:
            yield
        finally:
            self.bar.close()
            if self.logger is not None:
                self.logger.close()
            if experience is not None and self.at_step < self.tc.max_steps:
                experience.close(finished=False)

    def finish(self, step: int, experience, export: Callable[[], Path]) -> Path:
        """The last checkpoint (unless this step has one) and final/; the samplers stop once it is safe."""
        try:
            if self.last_saved != step:
                self.save(step)
            return export()
        finally:
            if experience is not None:
                experience.close(finished=True)


def summarize_groups(groups: list[Group]) -> dict:
    """A step's reward and length statistics. Reward statistics skip what does not apply: reward_mean
    and reward_std are over the scored completions (Completion.scored), each `reward_<name>` mean and
    accuracy over the completions where that component is not None; null where none is.
    finished_fraction: the completions that sampled EOS (1 - it: those cut at max_new_tokens, TRL's
    completions/clipped_ratio); zero_variance_groups counts the groups whose scored rewards are all
    equal (no learning signal), frac_reward_zero_std is their fraction of the groups."""
    completions = [c for g in groups for c in g.completions]
    rewards = [c.reward for c in completions if c.scored]
    lengths = [len(c.generated_token_ids) for c in completions]

    def applied(name: str) -> list[float]:
        return [c.reward_info[name] for c in completions if c.reward_info.get(name) is not None]

    def accuracy(name: str) -> float | None:
        values = applied(name)
        return sum(v > 0 for v in values) / len(values) if values else None

    stats = {
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
        "answer_accuracy": accuracy("answer"),
        "format_accuracy": accuracy("format")
        if accuracy("format") is not None
        else accuracy("format_partial"),
        "tokens_generated": sum(lengths),
        "completion_length_mean": statistics.fmean(lengths),
        "finished_fraction": sum(c.is_finished for c in completions) / len(completions),
        "zero_variance_groups": sum(len(set(g.scored_rewards)) <= 1 for g in groups),
        "frac_reward_zero_std": sum(len(set(g.scored_rewards)) <= 1 for g in groups) / len(groups),
        "completions_unscored": len(completions) - len(rewards),
        **episode_fields(groups),  # agent runs: turns, tool calls and errors, episode lengths
    }
    for name in completions[0].reward_info:
        values = applied(name)
        stats[f"reward_{name}"] = statistics.fmean(values) if values else None
    return stats


def sample_rows(groups: list[Group]) -> list[dict]:
    """The sample log's rows: each completion with its prompt's gold answer and other columns (as the
    sampler sent them) and the response the rewards scored (prefill + text)."""
    return [
        {
            "prompt_id": g.prompt_id,
            "answer": g.metadata.get("answer"),
            **({"columns": g.metadata["columns"]} if "columns" in g.metadata else {}),
            "policy_version": g.policy_version,
            "response": g.metadata.get("prefill", "") + c.text,
            "reward": c.reward,
            "reward_info": c.reward_info,
            "advantage": c.advantage,
            "is_finished": c.is_finished,
        }
        for g in groups
        for c in g.completions
    ]


def save_rl(
    checkpoints_dir: Path, step: int, engine, env: DistEnv, generator, tokenizer, experience, tc, **extra
) -> None:
    """A checkpoint of an RL run: the run.save one plus the experience's position (rank 0's)."""
    state = {"experience": experience.state_dict()} if env.is_main else {}
    run.save(checkpoints_dir, step, engine, env, generator, tokenizer, state, tc.save_total_limit, **extra)
