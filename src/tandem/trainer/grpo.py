"""The GRPO training loop: take groups, update the policy, publish weights, repeat.

Groups come from `trainer/experience.py`: generated in this process (`pipeline.mode: colocated`)
or received from sampler processes (`decoupled`, run by `tandem train`; `tandem grpo` starts both
sides). Each batch of prompts_per_step
prompts gives prompts_per_step x num_generations completions; they are split into optimizer
batches of micro_batch_size x gradient_accumulation_steps sequences, num_iterations times.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.grpo import grpo_loss
from tandem.config import Config, ConfigError, config_to_dict, validate_batch
from tandem.data.stream import prompt_stream
from tandem.distributed.engine import build_engine
from tandem.distributed.env import (
    DistEnv,
    all_reduce_sum,
    broadcast_after_waits,
    keep_alive,
    scatter_tensor_dicts,
)
from tandem.distributed.runtime import autocast, peak_rss_gb
from tandem.sampler.rollout import build_rollout
from tandem.trainer import checkpoint as ckpt
from tandem.trainer import run
from tandem.trainer.batching import (
    Sample,
    collate,
    flatten_groups,
    loss_normalizer,
    samples_from_tensors,
    samples_to_tensors,
    split_across_ranks,
    split_micro_batches,
)
from tandem.trainer.experience import LocalExperience, RemoteExperience, publishes_at
from tandem.trainer.metrics import MetricsLogger, write_samples
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed
from tandem.types import Group

log = logging.getLogger(__name__)
LOCAL = DistEnv()


@dataclass
class Share:
    """One rank's part of an optimizer batch (see scatter_share)."""

    samples: list[Sample]
    normalizer: float  # the whole batch's count the loss divides by (DESIGN.md section 6)
    num_micro: int  # micro-batches every rank runs this step
    padding: bool  # the samples only stand in (weight 0): this rank got no groups
    num_global: int  # sequences in the whole batch

    @classmethod
    def local(cls, samples: list[Sample], cfg: Config) -> Share:
        """The whole batch on one process (no process group)."""
        return scatter_share(LOCAL, samples, cfg)


def train_grpo(cfg: Config) -> Path:
    """Train, checkpoint and export; returns the folder of the final HF model.

    `pipeline.mode: colocated` generates in this process; `decoupled` makes this process the
    trainer of the sampler/trainer pipeline (groups from `tandem sample` processes). Under
    torchrun / the deepspeed launcher every rank runs this; rank 0 alone takes groups in,
    splits each optimizer batch across the ranks, logs, saves and publishes weights.
    """
    return run_distributed(cfg, _train)


def _train(cfg: Config, env: DistEnv, device: torch.device) -> Path:
    validate_batch(cfg, env.world_size)
    run_dir, tc = cfg.run_dir, cfg.training
    checkpoints_dir = run_dir / "checkpoints"
    resume_path = open_run(cfg, env)
    tokenizer, policy = load_policy(cfg, env, device)
    engine = build_engine(policy, tc, env, device)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    step = 0
    state = None
    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path, engine=engine, env=env, generator=generator)
        step = state["step"]
        if env.is_main:
            log.info("resumed from %s at step %d", resume_path, step)
    experience = open_experience(cfg, env, engine, tokenizer, generator, device, state)

    logger = (
        MetricsLogger(run_dir, tc.report_to, resume_step=step, config=config_to_dict(cfg))
        if env.is_main
        else None
    )
    bar = tqdm(total=tc.max_steps, initial=step, desc="grpo", dynamic_ncols=True, disable=not env.is_main)
    last_saved = step
    full_batch = cfg.grpo.prompts_per_step * cfg.sampling.num_generations
    steps_per_batch = batch_steps(tc, full_batch, cfg.grpo.num_iterations, env.world_size)
    if experience is not None:
        experience.expect(step, 0, steps_per_batch)
    try:
        while step < tc.max_steps:
            row_start = time.perf_counter()
            samples, groups, batch_stats = [], [], {}
            if env.is_main:
                groups, batch_stats = experience.next_groups(
                    cfg.grpo.prompts_per_step, lambda: keep_alive(env)
                )
                batch_stats = {**summarize_groups(groups), **batch_stats}
                samples = flatten_groups(
                    groups,
                    scale_rewards=cfg.grpo.scale_rewards,
                    adv_eps=cfg.grpo.adv_eps,
                    skip_zero_variance=cfg.grpo.skip_zero_variance_groups,
                )
                steps = batch_steps(tc, len(samples), cfg.grpo.num_iterations, env.world_size)
                experience.expect(step, steps, steps_per_batch)
            # every rank walks the same optimizer batches: rank 0 says how many sequences there are
            num_samples = broadcast_after_waits(env, len(samples) if env.is_main else None)
            batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
            for _ in range(cfg.grpo.num_iterations):
                for first in range(0, max(num_samples, 1), batch_size):
                    if step >= tc.max_steps:
                        break
                    share = (
                        scatter_share(env, samples[first : first + batch_size], cfg) if env.is_main else None
                    )
                    if not env.is_main:
                        share = scatter_share(env, None, cfg)
                    train_stats = optimizer_step(engine, share, cfg, device, env)
                    step += 1
                    sync_stats = {}
                    # ZeRO-3: every rank gathers the full parameters, so only for a step that publishes
                    with engine.gathered() if publishes_at(cfg, step) else contextlib.nullcontext():
                        if env.is_main:
                            # versions between the weights that sampled this batch and the ones updated now
                            staleness = statistics.fmean(
                                experience.version - g.policy_version for g in groups
                            )
                            sync_stats = experience.on_step(engine.module, step)
                    if not env.is_main:
                        continue
                    now = time.perf_counter()
                    row = {
                        "step": step,
                        "policy_version": min(g.policy_version for g in groups),
                        "staleness_mean": staleness,
                        **batch_stats,
                        **train_stats,
                        **sync_stats,
                        "step_seconds": now - row_start,
                        "peak_rss_gb": peak_rss_gb(),
                    }
                    if env.world_size > 1:
                        row["world_size"] = env.world_size
                    # a batch's generation and waiting are counted once, in its first step's row
                    batch_stats = {**batch_stats, **dict.fromkeys(PER_BATCH_TIMES & batch_stats.keys(), 0.0)}
                    row_start = now
                    if step % tc.logging_steps == 0 or step == tc.max_steps:
                        logger.log(row)
                    bar.update(1)
                    bar.set_postfix(
                        reward=f"{row['reward_mean']:.2f}",
                        fmt=f"{row['format_accuracy'] or 0:.2f}",
                        acc=f"{row['answer_accuracy'] or 0:.2f}",
                        kl=f"{row['kl']:.4f}",
                        s=f"{row['step_seconds']:.1f}",
                    )
            if (
                env.is_main
                and tc.sample_log_steps
                and (step // tc.sample_log_steps > (step - 1) // tc.sample_log_steps or step == 1)
            ):
                write_samples(run_dir, step, sample_rows(groups, cfg.data.prefill))
            if tc.save_steps and step // tc.save_steps > last_saved // tc.save_steps:
                save(checkpoints_dir, step, engine, env, generator, tokenizer, experience, tc)
                last_saved = step
    finally:
        bar.close()
        if logger is not None:
            logger.close()
        if (
            experience is not None and step < tc.max_steps
        ):  # interrupted or failed: samplers will see a restarted trainer
            experience.close(finished=False)
    try:
        if last_saved != step:
            save(checkpoints_dir, step, engine, env, generator, tokenizer, experience, tc)
        return export_final(engine, env, tokenizer, run_dir / "final")
    finally:
        if experience is not None:
            experience.close(finished=True)  # samplers stop once the final model is safe


PER_BATCH_TIMES = {"time_generate", "time_reference", "time_reward", "wait_seconds"}


def batch_steps(tc, num_samples: int, iterations: int, world_size: int) -> int:
    """Optimizer steps that one batch of `num_samples` sequences makes: `iterations` passes, each in
    optimizer batches of micro_batch_size x gradient_accumulation_steps x world_size (GRPO still
    steps once on a batch whose groups were all skipped)."""
    per_step = tc.micro_batch_size * tc.gradient_accumulation_steps * world_size
    return iterations * max(1, math.ceil(num_samples / per_step))


def open_experience(cfg: Config, env: DistEnv, engine, tokenizer, generator, device, state: dict | None):
    """Where groups come from, on rank 0 (None on the others): this process's own rollout
    (colocated) or the samplers (decoupled, whose RemoteExperience publishes the initial weights:
    every rank takes part in gathering them under ZeRO-3)."""
    if not env.is_main:
        with engine.gathered():
            return None
    if cfg.pipeline.mode == "colocated":
        if getattr(engine, "stage", 0) == 3:
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
    return experience


def local_experience(cfg: Config, policy, tokenizer, generator, device) -> LocalExperience:
    stream = prompt_stream(cfg.data, cfg.grpo.prompts_per_step, seed=cfg.seed, stream_seed=cfg.seed)
    return LocalExperience(build_rollout(cfg, policy, tokenizer, generator, device), stream, policy)


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


def optimizer_step(engine, share: Share, cfg: Config, device: torch.device, env: DistEnv = LOCAL) -> dict:
    """Gradient accumulation over this rank's micro-batches, global normalisation, clipping, one step.

    Every rank runs share.num_micro micro-batches (a short share repeats its last one with weight
    0), so the collectives inside DDP's and ZeRO's backward (and ZeRO-3's forward) line up."""
    tc, gc = cfg.training, cfg.grpo
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_abs_dev": 0.0}
    lr = engine.lr()
    if share.num_global == 0:
        # every group had zero reward variance and was skipped: nothing to learn from, so no
        # optimizer step and no scheduler step (the lr schedule counts real updates); the step
        # still counts toward max_steps and publishes its version, which keeps the samplers' pacing
        return {
            **stats,
            "grad_norm": 0.0,
            "lr": lr,
            "num_train_sequences": 0,
            "skipped": True,
            "time_train": 0.0,
            "time_optimizer": 0.0,
        }
    t0 = time.perf_counter()
    engine.model.train()
    micro_batches = split_micro_batches(share.samples, tc.micro_batch_size)
    weights = [0.0 if share.padding else 1.0] * len(micro_batches)
    while len(micro_batches) < share.num_micro:
        micro_batches.append(micro_batches[-1])
        weights.append(0.0)
    sums = [0.0] * 5  # loss, kl*n, clip*n, ratio_dev*n, n (token-weighted over real micro-batches)
    for i, (micro, weight) in enumerate(zip(micro_batches, weights)):
        mb = collate(micro).to(device)
        with engine.accumulate(last=i == len(micro_batches) - 1):
            with autocast(device, tc.mixed_precision):
                trainer_logprobs = engine.model(mb.packed, temperature=cfg.sampling.temperature)
            loss, s = grpo_loss(
                trainer_logprobs,
                mb.sampler_logprobs,
                mb.ref_logprobs,
                mb.advantages,
                mb.completion_mask,
                clip_eps_low=gc.clip_eps_low,
                clip_eps_high=gc.clip_eps_high,
                kl_coef=gc.kl_coef,
                loss_agg=gc.loss_agg,
                normalizer=share.normalizer,
                max_completion_length=cfg.sampling.max_new_tokens,
            )
            engine.backward(loss * weight)
        if weight:
            n = s["num_tokens"]
            for k, value in enumerate(
                (float(loss.detach()), s["kl"] * n, s["clip_fraction"] * n, s["ratio_abs_dev"] * n, n)
            ):
                sums[k] += value
    t1 = time.perf_counter()
    grad_norm = engine.step()
    loss_sum, kl, clip, dev, num_tokens = all_reduce_sum(env, sums)
    return {
        "loss": loss_sum,
        "kl": kl / max(num_tokens, 1.0),
        "clip_fraction": clip / max(num_tokens, 1.0),
        "ratio_abs_dev": dev / max(num_tokens, 1.0),
        "grad_norm": grad_norm,
        "lr": lr,
        "num_train_sequences": share.num_global,
        "skipped": False,
        "time_train": t1 - t0,
        "time_optimizer": time.perf_counter() - t1,
    }


def summarize_groups(groups: list[Group]) -> dict:
    completions = [c for g in groups for c in g.completions]
    rewards = [c.reward for c in completions]
    lengths = [len(c.generated_token_ids) for c in completions]

    def accuracy(name: str) -> float | None:
        if name not in completions[0].reward_info:
            return None
        return sum(c.reward_info[name] > 0 for c in completions) / len(completions)

    stats = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "answer_accuracy": accuracy("answer"),
        "format_accuracy": accuracy("format")
        if accuracy("format") is not None
        else accuracy("format_partial"),
        "tokens_generated": sum(lengths),
        "completion_length_mean": statistics.fmean(lengths),
        "finished_fraction": sum(c.is_finished for c in completions) / len(completions),
        "zero_variance_groups": sum(len(set(g.rewards)) <= 1 for g in groups),
    }
    for name in completions[0].reward_info:
        stats[f"reward_{name}"] = statistics.fmean(c.reward_info[name] for c in completions)
    return stats


def sample_rows(groups: list[Group], prefill: str) -> list[dict]:
    return [
        {
            "prompt_id": g.prompt_id,
            "answer": g.metadata.get("answer"),
            "policy_version": g.policy_version,
            "response": prefill + c.text,
            "reward": c.reward,
            "reward_info": c.reward_info,
            "advantage": c.advantage,
            "is_finished": c.is_finished,
        }
        for g in groups
        for c in g.completions
    ]


def save(checkpoints_dir, step, engine, env, generator, tokenizer, experience, tc) -> None:
    state = {"experience": experience.state_dict()} if env.is_main else {}
    run.save(checkpoints_dir, step, engine, env, generator, tokenizer, state, tc.save_total_limit)
