"""The PPO training loop (`tandem ppo CONFIG`): take groups, update the policy and its value head,
publish weights, repeat.

PPO runs on GRPO's sampler/trainer split (trainer/grpo.py, DESIGN.md section 1): samplers (or this
process, `pipeline.mode: colocated`) generate completions with their sampler (old-policy) and
reference log-probs and rewards; prompts per step come from `ppo.prompts_per_step` (unset: from
`grpo.prompts_per_step`, its older name; `cfg.prompts_per_step` says which), and
`sampling.num_generations` may be 1. The sampler knows nothing of values:
**the trainer computes them**, with a value head on the policy's trunk (models/value_head.py), so
the wire format, the samplers and weight sync stay GRPO's and values always come from the newest
critic. Per batch of groups, rank 0 splits each optimizer batch across the ranks by whole groups
(trainer/rl_steps.py, as for GRPO) and every rank, for its share:
  1. old values V_old: one forward without gradient, before any update of this batch;
  2. token rewards: the score on the last token, minus kl_coef * (logp_sampler - logp_ref) on every
     token when ppo.kl_mode=reward (Ziegler et al. 2019); with kl_mode=loss the rewards are the
     score alone and kl_coef * KL_k3(policy || reference) joins the loss (as GRPO's);
  3. GAE(gamma, lam) -> advantages, returns; advantages whitened with the mean and variance of the
     whole batch, all ranks (ppo.whiten_advantages).
Then ppo.num_iterations passes over the optimizer batches: clipped surrogate (ratio against the
sampler's log-probs) + vf_coef * clipped value loss, divided by the optimizer batch's global
number of completion tokens. The head trains in the policy's optimizer at its learning rate (as
TRL's classic value-head PPO). Checkpoints and final/ hold the policy plus value_head.safetensors.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.algorithms.logprobs import kl_k3
from tandem.algorithms.ppo import gae, kl_penalized_rewards, ppo_policy_loss, value_loss, whiten
from tandem.config import Config, ConfigError, validate_batch
from tandem.distributed.batches import pad_micro_batches
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv, all_reduce_dict
from tandem.distributed.runtime import autocast
from tandem.models.value_head import ValueHeadModel
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.batching import MicroBatch, collate, split_micro_batches
from tandem.trainer.rl_steps import RankBatches, Share, StepRecord, open_experience, publish, save_rl
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)
LOCAL = DistEnv()


@dataclass
class Micro:
    """One micro-batch of this rank's share with its PPO targets, fixed for the whole batch."""

    batch: MicroBatch
    scores: torch.Tensor  # [B] sequence rewards
    old_values: torch.Tensor  # [B, T]
    returns: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T], whitened over the whole batch once every rank has its own
    weight: float  # 0: a stand-in that keeps the ranks' collectives in step (see grpo.optimizer_step)


@dataclass
class OptimizerBatch:
    """This rank's micro-batches of one optimizer step."""

    micros: list[Micro]
    num_tokens: float  # completion tokens of the whole optimizer batch, all ranks: the loss divisor
    num_sequences: int  # sequences of the whole optimizer batch


def train_ppo(cfg: Config) -> Path:
    """Train, checkpoint and export; returns the folder of the final HF model (with its
    value_head.safetensors). Pipeline modes and ranks as train_grpo."""
    return run_distributed(cfg, _train)


def _train(cfg: Config, env: DistEnv, device: torch.device) -> Path:
    validate_batch(cfg, env.world_size)
    if env.is_main and cfg.ppo.prompts_per_step is None:
        log.info(
            "ppo.prompts_per_step is unset: %d prompts per batch, from grpo.prompts_per_step",
            cfg.prompts_per_step,
        )
    pc, tc = cfg.ppo, cfg.training
    resume_path = open_run(cfg, env)
    tokenizer, policy = load_policy(cfg, env, device)
    forward = ValueHeadModel(policy)
    if pc.value_learning_rate is not None:  # a critic often wants a faster rate than the policy
        forward.learning_rates = {"value_head.": pc.value_learning_rate}
    engine = build_engine(policy, tc, env, device, forward=forward)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    state = None
    if resume_path is not None:
        state = ckpt.load_checkpoint(
            resume_path, engine=engine, env=env, generator=generator, load_extra=forward.load_value_head
        )
    step = state["step"] if state else 0
    if state and env.is_main:
        log.info("resumed from %s at step %d", resume_path, step)
    experience = open_experience(cfg, env, engine, tokenizer, generator, device, state)

    def save(at: int) -> None:
        save_rl(
            cfg.run_dir / "checkpoints",
            at,
            engine,
            env,
            generator,
            tokenizer,
            experience,
            tc,
            write_extra=forward.save_value_head,
        )

    record = StepRecord(cfg, env, step, desc="ppo", postfix=progress, save=save)
    batches = RankBatches(
        cfg,
        env,
        experience,
        step,
        num_iterations=pc.num_iterations,
        scale_rewards="none",
        adv_eps=0.0,
        skip_zero_variance=False,
    )
    with record.steps(experience):
        while step < tc.max_steps:
            record.start_batch()
            batch = batches.next(step)
            targets, target_stats = prepare_batch(engine, batch.shares, cfg, device, env)
            batch.stats.update(target_stats)
            for _ in range(pc.num_iterations):
                for optimizer_batch in targets:
                    if step >= tc.max_steps:
                        break
                    train_stats = optimizer_step(engine, optimizer_batch, cfg, device, env)
                    step += 1
                    record.step(
                        step, batch, train_stats, publish(experience, engine, cfg, step, batch.groups)
                    )
            record.end_batch(step, batch)
    final = cfg.run_dir / "final"
    return record.finish(
        step,
        experience,
        lambda: export_final(engine, env, tokenizer, final, write_extra=forward.save_value_head),
    )


def progress(row: dict) -> dict:
    """What the progress bar shows of a row."""
    return dict(
        reward="-" if row["reward_mean"] is None else f"{row['reward_mean']:.2f}",
        vloss=f"{row['value_loss']:.3f}",
        ev=f"{row['explained_variance'] or 0:.2f}",
        kl=f"{row['kl']:.4f}",
        s=f"{row['step_seconds']:.1f}",
    )


def padded_micro_batches(share: Share, micro_batch_size: int) -> list[tuple[list, float]]:
    """(micro-batch, weight) pairs of this rank's share, share.num_micro of them (distributed.batches)."""
    return pad_micro_batches(
        split_micro_batches(share.samples, micro_batch_size),
        share.num_micro,
        stand_in=share.samples,
        weight=0.0 if share.padding else 1.0,
    )


@torch.no_grad()
def prepare_batch(
    engine, shares: list[Share], cfg: Config, device: torch.device, env: DistEnv = LOCAL
) -> tuple[list[OptimizerBatch], dict]:
    """Old values, token rewards, GAE and whitened advantages for every optimizer batch of one batch
    of groups, with the current weights (before any update); returns the batches and the batch's
    value statistics (returns_mean, explained_variance, ...), global over the ranks."""
    pc, tc = cfg.ppo, cfg.training
    kl_in_reward = pc.kl_coef if pc.kl_mode == "reward" else 0.0
    engine.model.eval()
    batches, tokens = [], {}
    # over the real tokens of every optimizer batch; residual = R - V_old
    sums = dict.fromkeys(("n", "adv", "ret", "ret_sq", "res", "res_sq", "value"), 0.0)
    for share in shares:
        micros = []
        for samples, weight in padded_micro_batches(share, tc.micro_batch_size):
            mb = collate(samples).to(device)
            mask = mb.completion_mask
            with autocast(device, tc.mixed_precision):
                _, old_values = engine.model(mb.packed, temperature=cfg.sampling.temperature)
            old_values = old_values.float() * mask
            scores = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device)
            rewards = kl_penalized_rewards(
                scores, mb.sampler_logprobs, reference_logprobs(mb, pc.kl_coef), mask, kl_coef=kl_in_reward
            )
            advantages, returns = gae(rewards, old_values, mask, gamma=pc.gamma, lam=pc.lam)
            micros.append(Micro(mb, scores, old_values, returns, advantages, weight))
            if weight:
                keep = mask.double()
                residual = (returns - old_values).double()
                for key, value in (
                    ("n", keep.sum()),
                    ("adv", (advantages.double() * keep).sum()),
                    ("ret", (returns.double() * keep).sum()),
                    ("ret_sq", (returns.double() ** 2 * keep).sum()),
                    ("res", (residual * keep).sum()),
                    ("res_sq", (residual**2 * keep).sum()),
                    ("value", (old_values.double() * keep).sum()),
                ):
                    sums[key] += float(value)
        tokens[f"tokens_{len(batches)}"] = sum(
            float(m.batch.completion_mask.sum()) for m in micros if m.weight
        )
        batches.append(OptimizerBatch(micros, 0.0, share.num_global))
    reduced = all_reduce_dict(env, {**tokens, **sums})
    for i, batch in enumerate(batches):
        batch.num_tokens = reduced[f"tokens_{i}"]
    n = max(reduced["n"], 1.0)
    adv_sum, ret_sum, ret_sq, res_sum, res_sq, value_sum = (
        reduced[k] for k in ("adv", "ret", "ret_sq", "res", "res_sq", "value")
    )
    stats = {
        "returns_mean": ret_sum / n,
        "values_mean": value_sum / n,
        "advantages_mean": adv_sum / n,
        "explained_variance": explained_variance(ret_sum / n, ret_sq / n, res_sum / n, res_sq / n),
    }
    if pc.whiten_advantages:
        whiten_global(batches, adv_sum / n, n, env)
    return batches, stats


def whiten_global(batches: list[OptimizerBatch], mean: float, n: float, env: DistEnv) -> None:
    """algorithms.ppo.whiten of every micro-batch with the moments of the whole batch, all ranks:
    the mean and population variance of every real token (two passes, as whiten makes them)."""
    micros = [m for b in batches for m in b.micros]
    squares = sum(
        float((((m.advantages.double() - mean) ** 2) * m.batch.completion_mask.double()).sum())
        for m in micros
        if m.weight
    )
    squares = all_reduce_dict(env, {"squares": squares})["squares"]
    for m in micros:
        m.advantages = whiten(m.advantages, m.batch.completion_mask, moments=(mean, squares / n))


def explained_variance(ret_mean: float, ret_sq_mean: float, res_mean: float, res_sq_mean: float) -> float:
    """1 - Var(R - V_old) / Var(R) over the batch's tokens: 1 = the critic predicts the returns,
    0 = no better than their mean; NaN (logged as null) when the returns do not vary."""
    var_returns = ret_sq_mean - ret_mean**2
    if var_returns <= 1e-12:
        return float("nan")
    return 1.0 - (res_sq_mean - res_mean**2) / var_returns


def reference_logprobs(mb: MicroBatch, kl_coef: float) -> torch.Tensor:
    """The reference's log-probs; without a reference (the sampler loads none when the KL weight is
    0) the sampler's stand in, which makes every KL term 0."""
    if mb.ref_logprobs is not None:
        return mb.ref_logprobs
    if kl_coef != 0:
        raise ConfigError(
            "`ppo.kl_coef` is not 0 but the groups carry no reference log-probs; were the samplers "
            "started with another config? Start them with this one (method: ppo), or set ppo.kl_coef=0"
        )
    return mb.sampler_logprobs


def optimizer_step(
    engine, batch: OptimizerBatch, cfg: Config, device: torch.device, env: DistEnv = LOCAL
) -> dict:
    """Gradient accumulation over this rank's micro-batches of one optimizer batch, one step.

    loss = [sum_t clipped surrogate + vf_coef * clipped value loss (+ kl_coef * KL_k3 when
    kl_mode=loss)] / tokens of the whole optimizer batch, so accumulation and world size leave the
    update unchanged."""
    pc, tc = cfg.ppo, cfg.training
    lr = engine.lr()
    t0 = time.perf_counter()
    engine.model.train()
    # the losses, then token-weighted sums (kl, clip, approx_kl, ratio dev, vf clip) and their tokens n
    sums = dict.fromkeys(
        ("loss", "policy_loss", "value_loss", "kl", "clip", "approx_kl", "ratio_dev", "vf_clip", "n"), 0.0
    )
    for i, m in enumerate(batch.micros):
        mb, mask = m.batch, m.batch.completion_mask
        with engine.accumulate(last=i == len(batch.micros) - 1):
            with autocast(device, tc.mixed_precision):
                logprobs, values = engine.model(mb.packed, temperature=cfg.sampling.temperature)
            policy_loss, ps = ppo_policy_loss(
                logprobs,
                mb.sampler_logprobs,
                m.advantages,
                mask,
                clip_eps=pc.clip_eps,
                normalizer=batch.num_tokens,
            )
            v_loss, vs = value_loss(
                values.float(),
                m.old_values,
                m.returns,
                mask,
                clip_eps=pc.value_clip_eps,
                normalizer=batch.num_tokens,
            )
            kl = kl_k3(logprobs, reference_logprobs(mb, pc.kl_coef)) * mask
            loss = policy_loss + pc.vf_coef * v_loss
            if pc.kl_mode == "loss":
                loss = loss + pc.kl_coef * kl.sum() / batch.num_tokens
            engine.backward(loss * m.weight)
        if m.weight:
            n = ps["num_tokens"]
            ratio_dev = float(((torch.exp(logprobs.detach() - mb.sampler_logprobs) - 1.0).abs() * mask).sum())
            for key, value in (
                ("loss", float(loss.detach())),
                ("policy_loss", float(policy_loss.detach())),
                ("value_loss", float(v_loss.detach())),
                ("kl", float(kl.detach().sum())),
                ("clip", ps["clip_fraction"] * n),
                ("approx_kl", ps["approx_kl"] * n),
                ("ratio_dev", ratio_dev),
                ("vf_clip", vs["value_clip_fraction"] * n),
                ("n", n),
            ):
                sums[key] += value
    t1 = time.perf_counter()
    grad_norm = engine.step()
    loss, p_loss, v_loss, kl, clip, approx_kl, ratio_dev, vf_clip, n = all_reduce_dict(env, sums).values()
    n = max(n, 1.0)
    return {
        "loss": loss,
        "policy_loss": p_loss,
        "value_loss": v_loss,
        "kl": kl / n,
        "clip_fraction": clip / n,
        "approx_kl": approx_kl / n,
        "ratio_abs_dev": ratio_dev / n,
        "vf_clip_fraction": vf_clip / n,
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "num_train_sequences": batch.num_sequences,
        "time_train": t1 - t0,
        "time_optimizer": time.perf_counter() - t1,
    }
