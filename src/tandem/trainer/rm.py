"""The reward-model loop: Bradley-Terry on (prompt, chosen, rejected) pairs, a scalar head on a causal LM;
with task harmless and answers labelled safe/unsafe, a Safe-RLHF cost model (plus a classification term).

Run: `tandem rm configs/rm_helpful.yaml [--task helpful|harmless] [key=value ...]` (under torchrun or
the deepspeed launcher for several ranks). An optimizer step takes micro_batch_size x
gradient_accumulation_steps x world_size pairs (the last of an epoch may be short); each rank takes its rank_slice, scores the chosen and
rejected answers of a micro-batch in one padded forward, and weighs its loss by its share of the
step's pairs (the classification term by its share of the step's labelled answers), so the update does
not depend on how the batch is cut. final/ is an HF
sequence-classification folder that `RewardScorer` and GRPO's `rewards: [{type: model}]` load.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.reward_model import cost_classification_loss, pairwise_loss
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
    cost_weight = classification_weight(cfg, train_set, env)
    batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
    steps_per_epoch = run.batches_per_epoch(len(train_set), batch_size, "pairs")
    num_steps = min(tc.max_steps, tc.num_epochs * steps_per_epoch)
    engine = build_engine(model, tc, env, device, forward=ScoreModule(model))

    # the data position is the step: batches are a function of (seed, epoch), checked on resume
    data_state = {"num_train_pairs": len(train_set), "batch_size": batch_size}
    step = run.resume_data_loop(resume_path, engine, env, data_state)
    logger = run.data_loop_logger(cfg, env, step)
    # the untrained head's accuracy (about chance), reported in the first row
    initial = evaluate(engine, eval_set, cfg.training, device, env, pad_id, cost_weight) if step == 0 else {}
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
            row = optimizer_step(engine, batch, cfg.training, device, env, pad_id, cost_weight)
            step += 1
            row = {"step": step, "epoch": step / steps_per_epoch, **row, **initial}
            row["step_seconds"], initial = time.perf_counter() - t0, {}
            if (tc.eval_steps and step % tc.eval_steps == 0) or step == num_steps:
                t1 = time.perf_counter()
                final_eval = evaluate(engine, eval_set, cfg.training, device, env, pad_id, cost_weight)
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
        info["classification_loss_weight"] = cost_weight  # null: no classification term (not a cost model)
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


def classification_weight(cfg: Config, train_set: list[EncodedPair], env: DistEnv = LOCAL) -> float | None:
    """rm.classification_loss_weight where the cost model's classification term applies (task harmless,
    training answers labelled safe/unsafe), else None; a harmless run on unlabelled data says so once."""
    if cfg.rm.task != "harmless":
        return None
    if num_labels(train_set) == 0:
        if env.is_main:
            log.info(
                "rm.task harmless: no training answer is labelled safe or unsafe (chosen_is_safe / "
                "rejected_is_safe, PKU-SafeRLHF's is_response_N_safe), so the cost model's "
                "classification term is skipped and the pairwise loss trains alone"
            )
        return None
    return cfg.rm.classification_loss_weight


def num_labels(pairs: list[EncodedPair]) -> int:
    """How many answers of `pairs` carry a safety label (0, 1 or 2 a pair)."""
    return sum((p.chosen_is_safe is not None) + (p.rejected_is_safe is not None) for p in pairs)


def labelled_scores(
    chosen: torch.Tensor, rejected: torch.Tensor, pairs: list[EncodedPair]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [M], is_safe [M] bool) of the M answers of `pairs` that carry a safety label, given the
    pairs' chosen and rejected scores [n]."""
    n = len(pairs)
    index = [i for i, p in enumerate(pairs) if p.chosen_is_safe is not None]
    index += [n + i for i, p in enumerate(pairs) if p.rejected_is_safe is not None]
    labels = [p.chosen_is_safe for p in pairs] + [p.rejected_is_safe for p in pairs]
    scores = torch.cat((chosen, rejected))  # [2n]
    is_safe = torch.tensor([labels[i] for i in index], dtype=torch.bool, device=scores.device)
    return scores[torch.tensor(index, dtype=torch.long, device=scores.device)], is_safe


def classification_term(
    chosen: torch.Tensor, rejected: torch.Tensor, pairs: list[EncodedPair], num_labelled: int
) -> tuple[torch.Tensor, float] | None:
    """The cost classification loss of `pairs`' labelled answers times their share of `num_labelled`
    (the step's count; 1 gives their sum), and how many have the label's sign (> 0 safe, < 0 unsafe, a
    score of 0 is a miss); None when none of them is labelled."""
    scores, is_safe = labelled_scores(chosen, rejected, pairs)
    if not len(scores):
        return None
    correct = float((torch.where(is_safe, scores.detach(), -scores.detach()) > 0).sum())
    return cost_classification_loss(scores, is_safe) * (len(scores) / num_labelled), correct


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
    classification_loss_weight: float | None = None,
) -> dict:
    """Gradient accumulation over this rank's micro-batches of the global `batch`: each micro-batch's
    mean pairwise loss is weighted by its pairs over the batch's (every rank holds the batch, so that
    count needs no collective), then clipping and one optimizer step. With a classification weight
    (None: no term), the loss adds weight x the cost classification loss, each micro-batch's mean
    weighted by its labelled answers over the batch's, and the row its loss and sign accuracy."""
    micro_batches = rank_micro_batches(batch, tc.micro_batch_size, env)
    num_labelled = num_labels(batch) if classification_loss_weight is not None else 0
    lr = engine.lr()
    engine.model.train()
    sums = {"loss": 0.0, "correct": 0.0, "margin_sum": 0.0}  # loss already divided by the batch
    if num_labelled:  # the same names on every rank: each holds the whole batch
        sums |= {"classification_loss": 0.0, "classification_correct": 0.0}
    for i, (micro, weight) in enumerate(micro_batches):
        with engine.accumulate(last=i == len(micro_batches) - 1):
            with autocast(device, tc.mixed_precision):
                chosen, rejected = score_pairs(engine.model, micro, device, pad_id)
            loss = pairwise_loss(chosen, rejected) * (weight * len(micro) / len(batch))
            term = classification_term(chosen, rejected, micro, num_labelled) if num_labelled else None
            if term is not None and classification_loss_weight:  # weight 0: reported, not trained
                loss = loss + classification_loss_weight * weight * term[0]
            engine.backward(loss)
        if weight:
            margins = (chosen - rejected).detach()
            sums["loss"] += float(loss.detach())
            sums["correct"] += float((margins > 0).sum())
            sums["margin_sum"] += float(margins.sum())
            if term is not None:
                sums["classification_loss"] += float(term[0].detach())
                sums["classification_correct"] += term[1]
    grad_norm = engine.step()
    totals = all_reduce_dict(env, sums)
    row = {
        "loss": totals["loss"],  # the pair mean over the whole batch (+ weight x the classification mean)
        "accuracy": totals["correct"] / len(batch),
        "margin_mean": totals["margin_sum"] / len(batch),  # chosen score - rejected score
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "pairs": len(batch),
    }
    if num_labelled:
        row["classification_loss"] = totals["classification_loss"]  # the labelled-answer mean
        row["classification_accuracy"] = totals["classification_correct"] / num_labelled
    return row


@torch.no_grad()
def evaluate(
    engine,
    pairs: list[EncodedPair],
    tc: TrainingConfig,
    device: torch.device,
    env: DistEnv = LOCAL,
    pad_id: int = 0,
    classification_loss_weight: float | None = None,
) -> dict:
    """eval_loss (mean pairwise loss), eval_accuracy (chosen scored strictly higher) and
    eval_margin_mean on held-out `pairs`, which the ranks split. With a classification weight and
    labelled answers, also eval_classification_loss and eval_classification_accuracy over those
    answers, and eval_loss is the trained objective (pairwise + weight x classification)."""
    if not pairs:
        return {}
    num_labelled = num_labels(pairs) if classification_loss_weight is not None else 0
    engine.model.eval()
    sums = {"loss_sum": 0.0, "correct": 0.0, "margin_sum": 0.0}
    if num_labelled:
        sums |= {"classification_loss_sum": 0.0, "classification_correct": 0.0}
    for micro, weight in rank_micro_batches(pairs, tc.micro_batch_size, env):
        with autocast(device, tc.mixed_precision):
            chosen, rejected = score_pairs(engine.model, micro, device, pad_id)
        if weight:
            margins = chosen - rejected
            sums["loss_sum"] += float(pairwise_loss(chosen, rejected)) * len(micro)
            sums["correct"] += float((margins > 0).sum())
            sums["margin_sum"] += float(margins.sum())
            term = classification_term(chosen, rejected, micro, 1) if num_labelled else None
            if term is not None:
                sums["classification_loss_sum"] += float(term[0])
                sums["classification_correct"] += term[1]
    engine.model.train()
    totals = all_reduce_dict(env, sums)
    out = {
        "eval_loss": totals["loss_sum"] / len(pairs),
        "eval_accuracy": totals["correct"] / len(pairs),
        "eval_margin_mean": totals["margin_sum"] / len(pairs),
    }
    if num_labelled:
        out["eval_classification_loss"] = totals["classification_loss_sum"] / num_labelled
        out["eval_classification_accuracy"] = totals["classification_correct"] / num_labelled
        out["eval_loss"] += classification_loss_weight * out["eval_classification_loss"]
    return out
