"""The GRPO training loop: take groups, update the policy, publish weights, repeat.

Groups come from `trainer/experience.py`: generated in this process (`pipeline.mode: colocated`)
or received from sampler processes (`decoupled`, run by `tandem train`; `tandem grpo` starts both
sides). Each batch of prompts_per_step
prompts gives prompts_per_step x num_generations completions; they are split into optimizer
batches of micro_batch_size x gradient_accumulation_steps sequences, num_iterations times.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.grpo import grpo_loss
from tandem.config import Config, config_to_dict, dump_config
from tandem.models.forward import packed_logprobs
from tandem.models.loading import load_causal_lm, load_tokenizer
from tandem.sampler.rollout import build_rollout, model_kwargs, prompt_stream
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.batching import collate, flatten_groups, loss_normalizer, split_micro_batches
from tandem.trainer.experience import LocalExperience, RemoteExperience
from tandem.trainer.metrics import MetricsLogger, write_samples
from tandem.trainer.optim import build_optimizer, build_scheduler
from tandem.trainer.runtime import (
    autocast,
    grad_scaler,
    peak_rss_gb,
    resolve_device,
    set_seed,
    set_threads,
    tune_allocator,
)
from tandem.types import Group

log = logging.getLogger(__name__)


def train_grpo(cfg: Config) -> Path:
    """Train, checkpoint and export; returns the folder of the final HF model.

    `pipeline.mode: colocated` generates in this process; `decoupled` makes this process the
    trainer of the sampler/trainer pipeline (groups from `tandem sample` processes).
    """
    set_seed(cfg.seed)
    set_threads(cfg.training.num_threads)
    tune_allocator()
    device = resolve_device(cfg.training.device)
    run_dir, tc = cfg.run_dir, cfg.training
    checkpoints_dir = run_dir / "checkpoints"
    resume_path = ckpt.resolve_resume(tc.resume_from_checkpoint, checkpoints_dir)
    if resume_path is None and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"{run_dir} already holds a run: set training.resume_from_checkpoint=latest to continue it, "
            "or choose another experiment_name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")

    tokenizer = load_tokenizer(
        cfg.model.tokenizer or cfg.model.policy, trust_remote_code=cfg.model.trust_remote_code
    )
    policy = load_causal_lm(cfg.model.policy, dtype=cfg.model.dtype, **model_kwargs(cfg, device))
    if tc.gradient_checkpointing:
        enable = (
            getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        )
        enable()
    policy.config.use_cache = False
    optimizer = build_optimizer(policy, tc)
    scheduler = build_scheduler(optimizer, tc)
    scaler = grad_scaler(device, tc.mixed_precision)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    step = 0
    state = None
    if resume_path is not None:
        state = ckpt.load_checkpoint(
            resume_path, model=policy, optimizer=optimizer, scheduler=scheduler, generator=generator
        )
        step = state["step"]
        log.info("resumed from %s at step %d", resume_path, step)
    if cfg.pipeline.mode == "colocated":
        experience = local_experience(cfg, policy, tokenizer, generator, device)
    else:
        experience = RemoteExperience(cfg, run_dir, policy)
    if state is not None:
        experience.load_state_dict(state["experience"])

    logger = MetricsLogger(run_dir, tc.report_to, resume_step=step, config=config_to_dict(cfg))
    bar = tqdm(total=tc.max_steps, initial=step, desc="grpo", dynamic_ncols=True)
    last_saved = step
    try:
        while step < tc.max_steps:
            row_start = time.perf_counter()
            groups, batch_stats = experience.next_groups(cfg.grpo.prompts_per_step)
            batch_stats = {**summarize_groups(groups), **batch_stats}
            samples = flatten_groups(
                groups,
                scale_rewards=cfg.grpo.scale_rewards,
                adv_eps=cfg.grpo.adv_eps,
                skip_zero_variance=cfg.grpo.skip_zero_variance_groups,
            )
            batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps
            for _ in range(cfg.grpo.num_iterations):
                for first in range(0, max(len(samples), 1), batch_size):
                    if step >= tc.max_steps:
                        break
                    opt_samples = samples[first : first + batch_size]
                    # versions between the weights that sampled this batch and the ones updated now
                    staleness = statistics.fmean(experience.version - g.policy_version for g in groups)
                    train_stats = optimizer_step(
                        policy, optimizer, scheduler, scaler, opt_samples, cfg, device
                    )
                    step += 1
                    sync_stats = experience.on_step(policy, step)
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
            if tc.sample_log_steps and (
                step // tc.sample_log_steps > (step - 1) // tc.sample_log_steps or step == 1
            ):
                write_samples(run_dir, step, sample_rows(groups, cfg.data.prefill))
            if tc.save_steps and step // tc.save_steps > last_saved // tc.save_steps:
                save(
                    checkpoints_dir, step, policy, optimizer, scheduler, generator, tokenizer, experience, tc
                )
                last_saved = step
    finally:
        bar.close()
        logger.close()
        if step < tc.max_steps:  # interrupted or failed: samplers will see a restarted trainer
            experience.close(finished=False)
    try:
        if last_saved != step:
            save(checkpoints_dir, step, policy, optimizer, scheduler, generator, tokenizer, experience, tc)
        return export_final(policy, tokenizer, run_dir / "final")
    finally:
        experience.close(finished=True)  # samplers stop once the final model is safe


PER_BATCH_TIMES = {"time_generate", "time_reference", "time_reward", "wait_seconds"}


def local_experience(cfg: Config, policy, tokenizer, generator, device) -> LocalExperience:
    stream = prompt_stream(cfg, cfg.grpo.prompts_per_step, seed=cfg.seed)
    return LocalExperience(build_rollout(cfg, policy, tokenizer, generator, device), stream, policy)


def optimizer_step(policy, optimizer, scheduler, scaler, samples, cfg: Config, device) -> dict:
    """Gradient accumulation over micro-batches, global normalisation, clipping, one AdamW step."""
    tc, gc = cfg.training, cfg.grpo
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_abs_dev": 0.0}
    lr = scheduler.get_last_lr()[0]
    if not samples:  # every group had zero reward variance and was skipped: nothing to learn from
        scheduler.step()
        return {
            **stats,
            "grad_norm": 0.0,
            "lr": lr,
            "num_train_sequences": 0,
            "time_train": 0.0,
            "time_optimizer": 0.0,
        }
    t0 = time.perf_counter()
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    normalizer = loss_normalizer(samples, gc.loss_agg)
    num_tokens = 0.0
    for micro in split_micro_batches(samples, tc.micro_batch_size):
        mb = collate(micro).to(device)
        with autocast(device, tc.mixed_precision):
            trainer_logprobs = packed_logprobs(policy, mb.packed, temperature=cfg.sampling.temperature)
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
            normalizer=normalizer,
            max_completion_length=cfg.sampling.max_new_tokens,
        )
        (scaler.scale(loss) if scaler else loss).backward()
        stats["loss"] += float(loss.detach())
        for key in ("kl", "clip_fraction", "ratio_abs_dev"):
            stats[key] += s[key] * s["num_tokens"]
        num_tokens += s["num_tokens"]
    t1 = time.perf_counter()
    if scaler:
        scaler.unscale_(optimizer)
    max_norm = tc.max_grad_norm if tc.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    # free the gradients now rather than at the next zero_grad: generation of the next batch
    # then runs without a model-sized buffer held (peak memory)
    optimizer.zero_grad(set_to_none=True)
    for key in ("kl", "clip_fraction", "ratio_abs_dev"):
        stats[key] /= max(num_tokens, 1.0)
    return {
        **stats,
        "grad_norm": grad_norm,
        "lr": lr,
        "num_train_sequences": len(samples),
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


def save(checkpoints_dir, step, policy, optimizer, scheduler, generator, tokenizer, experience, tc) -> None:
    ckpt.save_checkpoint(
        checkpoints_dir,
        step,
        model=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state={"experience": experience.state_dict()},
        generator=generator,
        tokenizer=tokenizer,
    )
    ckpt.prune_checkpoints(checkpoints_dir, tc.save_total_limit)


def export_final(policy, tokenizer, out: Path) -> Path:
    """The trained policy as an HF folder that AutoModelForCausalLM.from_pretrained loads."""

    def write(tmp: Path) -> None:
        policy.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return ckpt.atomic_dir(out, write)
