"""The GRPO training loop: take a batch of groups, update the policy, publish weights, repeat.

Groups come from `trainer/experience.py`: generated in this process (`pipeline.mode: colocated`)
or received from sampler processes (`decoupled`, run by `tandem train`; `tandem grpo` starts both
sides). A batch of prompts_per_step prompts gives prompts_per_step x num_generations completions;
`trainer/rl_steps.py` cuts them into optimizer batches of micro_batch_size x
gradient_accumulation_steps x ranks sequences and hands each rank its share, num_iterations times.
pi_old is the sampler's log-probs, or (`grpo.old_logprobs: trainer`) the trainer's own, recomputed
before a batch's first update; every batch compares the two where they used the same weights.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tandem.algorithms.grpo import grpo_loss, truncated_importance_weights
from tandem.config import Config, validate_batch
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv, all_reduce_dict
from tandem.distributed.runtime import autocast
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.batching import MicroBatch, collate
from tandem.trainer.rl_steps import RankBatches, Share, StepRecord, open_experience, publish, save_rl
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)
LOCAL = DistEnv()
# a step that compares no sampler and trainer log-probs (its weights are not those of the batch)
NOT_MEASURED = {"sampler_logprob_diff": None, "sampler_logprob_kl": None, "sampler_logprob_tokens": 0}
MISMATCH_SUMS = ("logprob_diff", "logprob_kl", "logprob_tokens")


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
        mask_truncated=gc.mask_truncated_completions,
    )
    with record.steps(experience):
        while step < tc.max_steps:
            record.start_batch()
            batch = batches.next(step)
            # pi_old from the trainer itself, which then also compares it with the sampler's; else
            # (None) the first step's forward, still at the batch's weights, makes that comparison
            mismatch = (
                recompute_old_logprobs(engine, batch.shares, cfg, device, env)
                if gc.old_logprobs == "trainer"
                else None
            )
            for _ in range(gc.num_iterations):
                for share in batch.shares:
                    if step >= tc.max_steps:
                        break
                    train_stats = optimizer_step(engine, share, cfg, device, env, mismatch=mismatch)
                    mismatch = NOT_MEASURED  # later steps start from updated weights
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
        reward="-" if row["reward_mean"] is None else f"{row['reward_mean']:.2f}",
        fmt=f"{row['format_accuracy'] or 0:.2f}",
        acc=f"{row['answer_accuracy'] or 0:.2f}",
        kl=f"{row['kl']:.4f}",
        s=f"{row['step_seconds']:.1f}",
    )


def optimizer_step(
    engine,
    share: Share,
    cfg: Config,
    device: torch.device,
    env: DistEnv = LOCAL,
    *,
    mismatch: dict | None = None,
) -> dict:
    """Gradient accumulation over this rank's micro-batches, global normalisation, clipping, one step.

    Every rank runs share.num_micro micro-batches (a short share repeats its last one with weight
    0), so the collectives inside DDP's and ZeRO's backward (and ZeRO-3's forward) line up.
    `mismatch` is the row's sampler/trainer log-prob comparison where it is already made (by
    `recompute_old_logprobs`, or NOT_MEASURED); None makes it from this step's forward, which must
    then start from the weights the batch was taken with (a batch's first step).
    The row's loss statistics are over the tokens the loss keeps (MicroBatch.loss_mask), all
    micro-batches and ranks: kl, ratio_abs_dev and entropy (of the policy's tempered next-token
    distribution, from the fused head) per token; clip_fraction, clip_ratio_low and clip_ratio_high per
    token, or per sequence under GSPO (grpo.importance_sampling_level: sequence)."""
    tc, gc = cfg.training, cfg.grpo
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "clip_ratio_low": 0.0, "clip_ratio_high": 0.0}
    stats.update(ratio_abs_dev=0.0, entropy=None)
    importance = dict.fromkeys(("importance_weight_mean", "importance_weight_capped"))
    lr = engine.lr()
    if share.num_global == 0 or share.normalizer == 0:
        # every group had zero reward variance and was skipped (or every completion was masked out
        # of the loss): nothing to learn from, so no optimizer step and no scheduler step (the lr
        # schedule counts real updates); the step still counts toward max_steps and publishes its
        # version, which keeps the samplers' pacing
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
            **(mismatch or NOT_MEASURED),
            **(importance if gc.importance_correction else {}),
        }
    t0 = time.perf_counter()
    engine.model.train()
    # token-weighted over the real micro-batches: kl, ratio_dev and entropy times num_tokens, the clip
    # fractions times their count (clip_n: tokens, or sequences under GSPO); the sampler/trainer
    # comparison's sums (MISMATCH_SUMS) and the importance weights' (is_*)
    sums = dict.fromkeys(("loss", "kl", "clip", "ratio_dev", "num_tokens", *MISMATCH_SUMS), 0.0)
    sums.update(clip_low=0.0, clip_high=0.0, clip_n=0.0, entropy=0.0)
    per_sequence = gc.importance_sampling_level == "sequence"
    if gc.importance_correction:
        sums.update(is_weight=0.0, is_capped=0.0)
    micro_batches = share.micro_batches(tc.micro_batch_size)
    for i, (micro, weight) in enumerate(micro_batches):
        mb = collate(micro).to(device)
        assert mb.old_logprobs is not None or gc.old_logprobs == "sampler", "recompute_old_logprobs first"
        old_logprobs = mb.old_logprobs if mb.old_logprobs is not None else mb.sampler_logprobs
        weights = (
            truncated_importance_weights(old_logprobs, mb.sampler_logprobs, gc.importance_cap)
            if gc.importance_correction
            else None
        )
        with engine.accumulate(last=i == len(micro_batches) - 1):
            with autocast(device, tc.mixed_precision):
                trainer_logprobs, entropy = engine.model(
                    mb.packed, temperature=cfg.sampling.temperature, return_entropy=True
                )
            loss, s = grpo_loss(
                trainer_logprobs,
                old_logprobs,
                mb.ref_logprobs,
                mb.advantages,
                mb.loss_mask,
                clip_eps_low=gc.clip_eps_low,
                clip_eps_high=gc.clip_eps_high,
                kl_coef=gc.kl_coef,
                loss_agg=gc.loss_agg,
                normalizer=share.normalizer,
                max_completion_length=cfg.completion_tokens[0],
                importance_weights=weights,
                importance_sampling_level=gc.importance_sampling_level,
            )
            engine.backward(loss * weight)
        if weight:
            n = s["num_tokens"]
            clip_n = s["num_sequences"] if per_sequence else n
            sums["loss"] += float(loss.detach())
            sums["kl"] += s["kl"] * n
            sums["clip"] += s["clip_fraction"] * clip_n
            sums["clip_low"] += s["clip_ratio_low"] * clip_n
            sums["clip_high"] += s["clip_ratio_high"] * clip_n
            sums["clip_n"] += clip_n
            sums["ratio_dev"] += s["ratio_abs_dev"] * n
            sums["entropy"] += float((entropy * mb.loss_mask).sum())
            sums["num_tokens"] += n
            if mismatch is None:
                add_mismatch(sums, trainer_logprobs.detach(), mb, share.on_batch_weights(micro))
            if weights is not None:
                mask = mb.loss_mask.to(weights.dtype)
                sums["is_weight"] += float((weights * mask).sum())
                sums["is_capped"] += float(((weights >= gc.importance_cap) * mask).sum())
    t1 = time.perf_counter()
    grad_norm = engine.step()
    totals = all_reduce_dict(env, sums)
    num_tokens = max(totals["num_tokens"], 1.0)
    clip_n = max(totals["clip_n"], 1.0)
    if gc.importance_correction:
        importance = {
            "importance_weight_mean": totals["is_weight"] / num_tokens,
            "importance_weight_capped": totals["is_capped"] / num_tokens,
        }
    return {
        "loss": totals["loss"],
        "kl": totals["kl"] / num_tokens,
        "clip_fraction": totals["clip"] / clip_n,
        "clip_ratio_low": totals["clip_low"] / clip_n,
        "clip_ratio_high": totals["clip_high"] / clip_n,
        "ratio_abs_dev": totals["ratio_dev"] / num_tokens,
        "entropy": totals["entropy"] / num_tokens,
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "num_train_sequences": share.num_global,
        "skipped": False,
        "time_train": t1 - t0,
        "time_optimizer": time.perf_counter() - t1,
        **(mismatch_fields(totals) if mismatch is None else mismatch),
        **(importance if gc.importance_correction else {}),
    }


@torch.no_grad()
def recompute_old_logprobs(
    engine, shares: list[Share], cfg: Config, device: torch.device, env: DistEnv = LOCAL
) -> dict:
    """`grpo.old_logprobs: trainer`, before a batch's first update: pi_old of every sample of this
    rank's shares from the trainer's own forward (Sample.old_logprobs), and the row fields comparing
    it with the sampler's log-probs over the whole batch (all ranks; see add_mismatch).

    The forwards cut each share into the micro-batches optimizer_step trains on and run at the same
    temperature and precision, so the first update's ratio is 1; eval mode, so no dropout. Every rank
    runs share.num_micro forwards per share (weight-0 repeats included), so the collectives inside
    DDP's and ZeRO-3's forward line up."""
    tc = cfg.training
    engine.model.eval()
    sums = dict.fromkeys(MISMATCH_SUMS, 0.0)
    for share in shares:
        for micro, weight in share.micro_batches(tc.micro_batch_size):
            mb = collate(micro).to(device)
            with autocast(device, tc.mixed_precision):
                trainer_logprobs = engine.model(mb.packed, temperature=cfg.sampling.temperature)
            for sample, row in zip(micro, trainer_logprobs.float().cpu()):
                sample.old_logprobs = row[: len(sample.completion_ids)]
            if weight:
                add_mismatch(sums, trainer_logprobs, mb, share.on_batch_weights(micro))
    return mismatch_fields(all_reduce_dict(env, sums))


def add_mismatch(
    sums: dict, trainer_logprobs: torch.Tensor, mb: MicroBatch, same_weights: list[bool]
) -> None:
    """Add to `sums` the token sums comparing the trainer's log-probs with the sampler's over the
    tokens of the samples made with the trainer's weights (`same_weights`; elsewhere the weights
    differ and so would the log-probs): |r| and Schulman's k3 exp(r) - r - 1, the estimate of
    KL(sampler || trainer) on the sampler's tokens, with r = logp_trainer - logp_sampler."""
    keep = torch.tensor(same_weights, device=mb.completion_mask.device)[:, None] & mb.completion_mask
    mask = keep.to(torch.float64)
    r = (trainer_logprobs.float() - mb.sampler_logprobs).double()
    sums["logprob_diff"] += float((r.abs() * mask).sum())
    sums["logprob_kl"] += float(((torch.expm1(r) - r) * mask).sum())  # expm1: exact for tiny r
    sums["logprob_tokens"] += float(mask.sum())


def mismatch_fields(sums: dict) -> dict:
    """The row fields of add_mismatch's (all-reduced) sums: token means, null where no token counts."""
    n = sums["logprob_tokens"]
    return {
        "sampler_logprob_diff": sums["logprob_diff"] / n if n else None,
        "sampler_logprob_kl": sums["logprob_kl"] / n if n else None,
        "sampler_logprob_tokens": int(n),
    }
