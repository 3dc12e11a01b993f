"""The reward-model loop: Bradley-Terry on (prompt, chosen, rejected) pairs, a scalar head on a causal LM.

Run: `tandem rm configs/rm_helpful.yaml [--task helpful|harmless] [key=value ...]` (under torchrun or
the deepspeed launcher for several ranks). An optimizer step takes micro_batch_size x
gradient_accumulation_steps x world_size pairs (the last of an epoch may be short); each rank takes its rank_slice, scores the chosen and
rejected answers of a micro-batch in one padded forward, and weighs its loss by its share of the
step's pairs, so the update does not depend on how the batch is cut. final/ is an HF
sequence-classification folder that `RewardScorer` and GRPO's `rewards: [{type: model}]` load.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.reward_model import pairwise_loss
from tandem.atomic import atomic_write_text
from tandem.config import Config, TrainingConfig
from tandem.data.preferences import EncodedPair, encode_pair, load_preferences
from tandem.distributed.batches import rank_micro_batches
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv, all_reduce_dict
from tandem.distributed.runtime import autocast
from tandem.models.reward import ScoreModule, load_reward_model, pad_right
from tandem.rewards.model import INFO_FILE
from tandem.trainer import run
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)
LOCAL = DistEnv()


def train_rm(cfg: Config) -> Path:
    """Train, evaluate, checkpoint and export; returns the final reward-model folder (a LoRA run:
    adapters and head in final/adapter, the merged model in final/)."""
    return run_distributed(cfg, _train)


def _train(cfg: Config, env: DistEnv, device: torch.device) -> Path:
    tc = cfg.training
    checkpoints_dir = cfg.run_dir / "checkpoints"
    resume_path = open_run(cfg, env)
    tokenizer, model = load_policy(cfg, env, device, loader=load_reward_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # pads are never attended
    if model.config.pad_token_id is None:  # HF's own seq-cls forward finds the last token with it
        model.config.pad_token_id = pad_id
    train_set, eval_set = load_data(cfg, tokenizer)
    batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
    steps_per_epoch = run.batches_per_epoch(len(train_set), batch_size, "pairs")
    num_steps = min(tc.max_steps, tc.num_epochs * steps_per_epoch)
    engine = build_engine(model, tc, env, device, forward=ScoreModule(model))

    # the data position is the step: batches are a function of (seed, epoch), checked on resume
    data_state = {"num_train_pairs": len(train_set), "batch_size": batch_size}
    step = run.resume_data_loop(resume_path, engine, env, data_state)
    logger = run.data_loop_logger(cfg, env, step)
    # the untrained head's accuracy (about chance), reported in the first row
    initial = evaluate(engine, eval_set, cfg.training, device, env, pad_id) if step == 0 else {}
    initial = {f"{k}_initial": v for k, v in initial.items()}
    bar = tqdm(total=num_steps, initial=step, desc="rm", dynamic_ncols=True, disable=not env.is_main)
    last_saved, batches, final_eval = step, (-1, []), {}  # batches: (epoch, its batches of pair indices)
    try:
        while step < num_steps:
            t0 = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            if batches[0] != epoch:
                batches = (
                    epoch,
                    run.epoch_batches(len(train_set), batch_size, epoch, cfg.seed, cfg.data.shuffle, "rm"),
                )
            batch = [train_set[i] for i in batches[1][index]]
            row = optimizer_step(engine, batch, cfg.training, device, env, pad_id)
            step += 1
            row = {"step": step, "epoch": step / steps_per_epoch, **row, **initial}
            row["step_seconds"], initial = time.perf_counter() - t0, {}
            if (tc.eval_steps and step % tc.eval_steps == 0) or step == num_steps:
                t1 = time.perf_counter()
                final_eval = evaluate(engine, eval_set, cfg.training, device, env, pad_id)
                row.update(final_eval, time_eval=time.perf_counter() - t1)
            if tc.save_steps and step % tc.save_steps == 0:
                run.save_data_loop(
                    checkpoints_dir,
                    step,
                    engine,
                    env,
                    tokenizer,
                    steps_per_epoch,
                    data_state,
                    tc.save_total_limit,
                )
                last_saved = step
            if not env.is_main:
                continue
            if env.world_size > 1:
                row["world_size"] = env.world_size
            if step % tc.logging_steps == 0 or step == num_steps or "eval_loss" in row:
                logger.log(row)
            bar.update(1)
            bar.set_postfix(
                loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.2f}", s=f"{row['step_seconds']:.1f}"
            )
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    if last_saved != step:
        run.save_data_loop(
            checkpoints_dir, step, engine, env, tokenizer, steps_per_epoch, data_state, tc.save_total_limit
        )
    final = export_final(engine, env, tokenizer, cfg.run_dir / "final")
    if env.is_main:
        info = {"task": cfg.rm.task, "max_length": cfg.rm.max_length, "base_model": cfg.model.policy}
        atomic_write_text(final / INFO_FILE, json.dumps({**info, "steps": step, **final_eval}, indent=2))
    return final


def load_data(cfg: Config, tokenizer) -> tuple[list[EncodedPair], list[EncodedPair]]:
    """(train, eval) encoded pairs; every rank builds the same lists (seeded). Eval: data.eval_dataset,
    else the held-out "test" split of a synthetic or hub set; a local training file without
    eval_dataset gets no eval."""
    d, task, max_length = cfg.data, cfg.rm.task, cfg.rm.max_length
    train = load_preferences(d.dataset, d.split, task=task, num_examples=d.num_examples, seed=cfg.seed)
    source = d.eval_dataset
    if source is None and not Path(d.dataset).expanduser().exists():
        source = d.dataset
    held_out = []
    if source is not None and d.num_eval_examples > 0:
        held_out = load_preferences(
            source, "test", task=task, num_examples=d.num_eval_examples, seed=cfg.seed
        )
    return (
        [encode_pair(tokenizer, p, max_length) for p in train],
        [encode_pair(tokenizer, p, max_length) for p in held_out],
    )


def score_pairs(model, pairs: list[EncodedPair], device: torch.device, pad_id: int):
    """(chosen scores [n], rejected scores [n]): the 2n answers of `pairs` in one right-padded forward."""
    sequences = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    input_ids, lengths = pad_right(sequences, pad_id)
    scores = model(input_ids.to(device), lengths.to(device))  # [2n]
    return scores[: len(pairs)], scores[len(pairs) :]


def optimizer_step(
    engine,
    batch: list[EncodedPair],
    tc: TrainingConfig,
    device: torch.device,
    env: DistEnv = LOCAL,
    pad_id: int = 0,
) -> dict:
    """Gradient accumulation over this rank's micro-batches of the global `batch`: each micro-batch's
    mean pairwise loss is weighted by its pairs over the batch's (every rank holds the batch, so that
    count needs no collective), then clipping and one optimizer step."""
    micro_batches = rank_micro_batches(batch, tc.micro_batch_size, env)
    lr = engine.lr()
    engine.model.train()
    sums = {"loss": 0.0, "correct": 0.0, "margin_sum": 0.0}  # loss already divided by the batch
    for i, (micro, weight) in enumerate(micro_batches):
        with engine.accumulate(last=i == len(micro_batches) - 1):
            with autocast(device, tc.mixed_precision):
                chosen, rejected = score_pairs(engine.model, micro, device, pad_id)
            loss = pairwise_loss(chosen, rejected) * (weight * len(micro) / len(batch))
            engine.backward(loss)
        if weight:
            margins = (chosen - rejected).detach()
            sums["loss"] += float(loss.detach())
            sums["correct"] += float((margins > 0).sum())
            sums["margin_sum"] += float(margins.sum())
    grad_norm = engine.step()
    loss_global, correct, margin_sum = all_reduce_dict(env, sums).values()
    return {
        "loss": loss_global,  # the pair mean over the whole batch
        "accuracy": correct / len(batch),
        "margin_mean": margin_sum / len(batch),  # chosen score - rejected score
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "pairs": len(batch),
    }


@torch.no_grad()
def evaluate(
    engine,
    pairs: list[EncodedPair],
    tc: TrainingConfig,
    device: torch.device,
    env: DistEnv = LOCAL,
    pad_id: int = 0,
) -> dict:
    """eval_loss (mean pairwise loss), eval_accuracy (chosen scored strictly higher) and
    eval_margin_mean on held-out `pairs`, which the ranks split."""
    if not pairs:
        return {}
    engine.model.eval()
    sums = {"loss_sum": 0.0, "correct": 0.0, "margin_sum": 0.0}
    for micro, weight in rank_micro_batches(pairs, tc.micro_batch_size, env):
        with autocast(device, tc.mixed_precision):
            chosen, rejected = score_pairs(engine.model, micro, device, pad_id)
        if weight:
            margins = chosen - rejected
            sums["loss_sum"] += float(pairwise_loss(chosen, rejected)) * len(micro)
            sums["correct"] += float((margins > 0).sum())
            sums["margin_sum"] += float(margins.sum())
    engine.model.train()
    loss_sum, correct, margin_sum = all_reduce_dict(env, sums).values()
    return {
        "eval_loss": loss_sum / len(pairs),
        "eval_accuracy": correct / len(pairs),
        "eval_margin_mean": margin_sum / len(pairs),
    }
