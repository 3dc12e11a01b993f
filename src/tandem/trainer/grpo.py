"""The GRPO training loop: take a batch of groups, update the policy, publish weights, repeat.

Groups come from `trainer/experience.py`: generated in this process (`pipeline.mode: colocated`)
or received from sampler processes (`decoupled`, run by `tandem train`; `tandem grpo` starts both
sides). A batch of prompts_per_step prompts gives prompts_per_step x num_generations completions;
`trainer/rl_steps.py` cuts them into optimizer batches of micro_batch_size x
gradient_accumulation_steps x ranks sequences and hands each rank its share, num_iterations times.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tandem.algorithms.grpo import grpo_loss
from tandem.config import Config, validate_batch
from tandem.distributed.batches import pad_micro_batches
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv, all_reduce_dict
from tandem.distributed.runtime import autocast
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.batching import collate, split_micro_batches
from tandem.trainer.rl_steps import RankBatches, Share, StepRecord, open_experience, publish, save_rl
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)
LOCAL = DistEnv()


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
    gc, tc = cfg.grpo, cfg.training
    resume_path = open_run(cfg, env)
    tokenizer, policy = load_policy(cfg, env, device)
    engine = build_engine(policy, tc, env, device)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    state = (
        ckpt.load_checkpoint(resume_path, engine=engine, env=env, generator=generator)
        if resume_path
        else None
    )
    step = state["step"] if state else 0
    if state and env.is_main:
        log.info("resumed from %s at step %d", resume_path, step)
    experience = open_experience(cfg, env, engine, tokenizer, generator, device, state)

    def save(at: int) -> None:
        save_rl(cfg.run_dir / "checkpoints", at, engine, env, generator, tokenizer, experience, tc)

    record = StepRecord(cfg, env, step, desc="grpo", postfix=progress, save=save)
    batches = RankBatches(
        cfg,
        env,
        experience,
        step,
        num_iterations=gc.num_iterations,
        scale_rewards=gc.scale_rewards,
        adv_eps=gc.adv_eps,
        skip_zero_variance=gc.skip_zero_variance_groups,
    )
    with record.steps(experience):
        while step < tc.max_steps:
            record.start_batch()
            batch = batches.next(step)
            for _ in range(gc.num_iterations):
                for share in batch.shares:
                    if step >= tc.max_steps:
                        break
                    train_stats = optimizer_step(engine, share, cfg, device, env)
                    step += 1
                    record.step(
                        step, batch, train_stats, publish(experience, engine, cfg, step, batch.groups)
                    )
            record.end_batch(step, batch)
    return record.finish(
        step, experience, lambda: export_final(engine, env, tokenizer, cfg.run_dir / "final")
    )


def progress(row: dict) -> dict:
    """What the progress bar shows of a row."""
    return dict(
        reward=f"{row['reward_mean']:.2f}",
        fmt=f"{row['format_accuracy'] or 0:.2f}",
        acc=f"{row['answer_accuracy'] or 0:.2f}",
        kl=f"{row['kl']:.4f}",
        s=f"{row['step_seconds']:.1f}",
    )


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
        engine.skips.nothing_to_learn()
        return {
            **stats,
            "grad_norm": 0.0,
            "skipped_nonfinite": False,
            "lr": lr,
            "num_train_sequences": 0,
            "skipped": True,
            "time_train": 0.0,
            "time_optimizer": 0.0,
        }
    t0 = time.perf_counter()
    engine.model.train()
    micro_batches = pad_micro_batches(
        split_micro_batches(share.samples, tc.micro_batch_size),
        share.num_micro,
        stand_in=share.samples,
        weight=0.0 if share.padding else 1.0,
    )
    # token-weighted over the real micro-batches: kl, clip and ratio_dev times num_tokens
    sums = dict.fromkeys(("loss", "kl", "clip", "ratio_dev", "num_tokens"), 0.0)
    for i, (micro, weight) in enumerate(micro_batches):
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
            sums["loss"] += float(loss.detach())
            sums["kl"] += s["kl"] * n
            sums["clip"] += s["clip_fraction"] * n
            sums["ratio_dev"] += s["ratio_abs_dev"] * n
            sums["num_tokens"] += n
    t1 = time.perf_counter()
    grad_norm = engine.step()
    loss_sum, kl, clip, dev, num_tokens = all_reduce_dict(env, sums).values()
    return {
        "loss": loss_sum,
        "kl": kl / max(num_tokens, 1.0),
        "clip_fraction": clip / max(num_tokens, 1.0),
        "ratio_abs_dev": dev / max(num_tokens, 1.0),
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "num_train_sequences": share.num_global,
        "skipped": False,
        "time_train": t1 - t0,
        "time_optimizer": time.perf_counter() - t1,
    }
