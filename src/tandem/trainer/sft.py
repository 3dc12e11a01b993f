"""The SFT loop: epochs over shuffled examples, the masked next-token loss, eval loss and perplexity.

Run: `tandem sft configs/sft_tiny.yaml [key=value ...]` (torchrun / the deepspeed launcher for several ranks).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.sft import sft_loss
from tandem.config import Config
from tandem.data.prompts import prompt_style
from tandem.data.sft import EncodedExample, PromptStyle, encode_examples, load_sft_splits
from tandem.distributed.batches import rank_micro_batches
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv, all_reduce_dict
from tandem.distributed.runtime import autocast
from tandem.models.attention import SegmentLayout
from tandem.models.forward import PackedRows, SequenceLayout
from tandem.trainer import run
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)
LOCAL = DistEnv()


def train_sft(cfg: Config) -> Path:
    """Train, evaluate, checkpoint and export; returns the folder of the final HF model (a LoRA
    run: adapters in final/adapter, the merged model in final/)."""
    return run_distributed(cfg, _train)


def _train(cfg: Config, env: DistEnv, device: torch.device) -> Path:
    """An optimizer step takes micro_batch_size x gradient_accumulation_steps x world_size examples
    (the last of an epoch may be short); each rank takes its rank_slice, and every micro-batch's loss
    is divided by the loss tokens of the whole step, so the update does not depend on how the batch
    is cut."""
    tc = cfg.training
    checkpoints_dir = cfg.run_dir / "checkpoints"
    resume_path = open_run(cfg, env)
    tokenizer, policy = load_policy(cfg, env, device)
    train_set, eval_set = load_data(cfg, tokenizer)
    batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
    steps_per_epoch = run.batches_per_epoch(len(train_set), batch_size, "examples")
    num_steps = min(tc.max_steps, tc.num_epochs * steps_per_epoch)
    engine = build_engine(policy, tc, env, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # pads are never attended

    # the data position is the step: batches are a function of (seed, epoch), checked on resume
    data_state = {"num_train_examples": len(train_set), "batch_size": batch_size}
    step = run.resume_data_loop(resume_path, engine, env, data_state)
    logger = run.data_loop_logger(cfg, env, step)
    # the baseline the run improves on (eval_loss_initial, eval_perplexity_initial in the first row)
    initial = evaluate(engine, eval_set, cfg, device, env, pad_id) if step == 0 else {}
    initial = {f"{k}_initial": v for k, v in initial.items()}
    if initial and env.is_main:
        log.info("eval loss before training %.4f", initial["eval_loss_initial"])
    bar = tqdm(total=num_steps, initial=step, desc="sft", dynamic_ncols=True, disable=not env.is_main)
    last_saved, batches = step, (-1, [])  # (epoch, its batches of example indices)
    try:
        while step < num_steps:
            t0 = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            if batches[0] != epoch:
                batches = (
                    epoch,
                    run.epoch_batches(len(train_set), batch_size, epoch, cfg.seed, cfg.data.shuffle, "sft"),
                )
            batch = [train_set[i] for i in batches[1][index]]
            row = optimizer_step(engine, batch, cfg, device, env, pad_id)
            step += 1
            row = {
                "step": step,
                "epoch": step / steps_per_epoch,
                **row,
                "step_seconds": time.perf_counter() - t0,
            }
            if (tc.eval_steps and step % tc.eval_steps == 0) or step == num_steps:
                t1 = time.perf_counter()
                row.update(evaluate(engine, eval_set, cfg, device, env, pad_id))
                row["time_eval"] = time.perf_counter() - t1
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
                logger.log({**row, **initial})
                initial = {}  # reported once, in the first row written
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", s=f"{row['step_seconds']:.1f}")
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    if last_saved != step:
        run.save_data_loop(
            checkpoints_dir, step, engine, env, tokenizer, steps_per_epoch, data_state, tc.save_total_limit
        )
    return export_final(engine, env, tokenizer, cfg.run_dir / "final")


def load_data(cfg: Config, tokenizer) -> tuple[list[EncodedExample], list[EncodedExample]]:
    """(train, eval) token ids with loss masks; every rank builds the same lists (seeded)."""
    d, sft = cfg.data, cfg.sft
    train, held_out = load_sft_splits(
        tokenizer,
        d.dataset,
        split=d.split,
        num_examples=d.num_examples,
        eval_dataset=d.eval_dataset,
        num_eval_examples=d.num_eval_examples,
        seed=cfg.seed,
        difficulty=d.difficulty,
        style=sft_style(d),
    )
    kw = dict(max_length=sft.max_length, completion_only_loss=sft.completion_only_loss)
    return (
        encode_examples(tokenizer, train, what="train", **kw),
        encode_examples(tokenizer, held_out, what="eval", **kw),
    )


def sft_style(data) -> PromptStyle:
    """GRPO's prompt format of a question (data/prompts.py prompt_style), so an SFT model continues
    straight into GRPO."""
    style = prompt_style(data, from_question=True)
    return PromptStyle(style.system_prompt, len(style.shots), style.prefill, list(style.shots))


def optimizer_step(
    engine,
    batch: list[EncodedExample],
    cfg: Config,
    device: torch.device,
    env: DistEnv = LOCAL,
    pad_id: int = 0,
) -> dict:
    """Gradient accumulation over this rank's micro-batches of the global `batch`, each loss divided
    by the loss tokens of the whole batch (every rank holds it, so that count needs no collective),
    clipping, one optimizer step."""
    tc = cfg.training
    num_tokens = sum(e.num_targets for e in batch)
    micro_batches = rank_micro_batches(batch, tc.micro_batch_size, env)
    lr = engine.lr()
    engine.model.train()
    loss_sum = 0.0
    for i, (micro, weight) in enumerate(micro_batches):
        packed, loss_mask = collate(micro, pad_id, packing=cfg.sft.packing, row_length=cfg.sft.max_length)
        with engine.accumulate(last=i == len(micro_batches) - 1):
            with autocast(device, tc.mixed_precision):
                token_logprobs = engine.model(packed.to(device))
            loss, _ = sft_loss(token_logprobs, loss_mask.to(device), normalizer=num_tokens)
            engine.backward(loss * weight)
        loss_sum += float(loss.detach()) * weight
    grad_norm = engine.step()
    return {
        "loss": all_reduce_dict(env, {"loss": loss_sum})["loss"],  # the token mean over the whole batch
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "tokens": num_tokens,
        "input_tokens": sum(len(e.input_ids) for e in batch),
    }


@torch.no_grad()
def evaluate(
    engine,
    examples: list[EncodedExample],
    cfg: Config,
    device: torch.device,
    env: DistEnv = LOCAL,
    pad_id: int = 0,
) -> dict:
    """eval_loss, the token-mean NLL of `examples` (ranks split them), and eval_perplexity = exp of it."""
    if not examples:
        return {}
    engine.model.eval()
    sums = {"nll_sum": 0.0, "num_tokens": 0.0}
    for micro, weight in rank_micro_batches(examples, cfg.training.micro_batch_size, env):
        packed, loss_mask = collate(micro, pad_id, packing=cfg.sft.packing, row_length=cfg.sft.max_length)
        with autocast(device, cfg.training.mixed_precision):
            token_logprobs = engine.model(packed.to(device))
        _, stats = sft_loss(token_logprobs, loss_mask.to(device))
        if weight:
            sums = {k: v + stats[k] for k, v in sums.items()}
    engine.model.train()
    nll_sum, num_tokens = all_reduce_dict(env, sums).values()
    eval_loss = nll_sum / num_tokens
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(eval_loss)}


def collate(
    examples: list[EncodedExample], pad_id: int, *, packing: bool, row_length: int
) -> tuple[PackedRows, torch.Tensor]:
    """A micro-batch's model input and its loss mask [N, T] (N examples, T the longest scored
    stretch): one example per padded row, or (packing) examples placed first-fit, longest first,
    into rows of at most row_length tokens. The mask rows follow the order of the log-probs,
    examples row by row."""
    if packing:
        rows: list[list[EncodedExample]] = []
        room: list[int] = []
        for e in sorted(examples, key=lambda e: len(e.input_ids), reverse=True):
            r = next((r for r, free in enumerate(room) if free >= len(e.input_ids)), None)
            if r is None:
                rows.append([])
                room.append(max(row_length, len(e.input_ids)))
                r = len(rows) - 1
            rows[r].append(e)
            room[r] -= len(e.input_ids)
    else:
        rows = [[e] for e in examples]
    ordered = [e for row in rows for e in row]
    firsts = [first_target(e) for e in ordered]
    loss_mask = torch.zeros(len(ordered), max(len(e.input_ids) - f for e, f in zip(ordered, firsts)))
    for k, (e, first) in enumerate(zip(ordered, firsts)):
        loss_mask[k, : len(e.input_ids) - first] = torch.tensor(e.loss_mask[first:], dtype=torch.float32)
    packed = pack_examples([[(e.input_ids, first_target(e)) for e in row] for row in rows], pad_id)
    return packed, loss_mask


def first_target(example: EncodedExample) -> int:
    """Index of the example's first loss token: the output projection (a vocabulary-wide matmul) runs
    from there on only, not over a prompt the loss ignores (7x fewer positions on GRPO's prompts)."""
    return example.loss_mask.index(1) if 1 in example.loss_mask else len(example.loss_mask)


def pack_examples(rows: list[list[tuple[list[int], int]]], pad_id: int = 0) -> PackedRows:
    """rows: the examples each row holds, as (token ids, index of the first token to score, >= 1)
    -> PackedRows whose "completions" are the scored stretches. Attention is causal within an
    example only (block-diagonal) and position ids restart at 0 for each, so every token is scored
    as if its example were alone, and packed_logprobs gives [num_examples, longest stretch]
    however the examples share rows."""
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)  # pads: -1, they see only pads
    pred_rows, pred_cols, targets, lengths = [], [], [], []
    segments = []  # for segment attention: a row's first example is its prefix, the others see only themselves
    sequences = []  # for flash-attention: every example alone
    for r, row in enumerate(rows):
        start = 0
        for k, (ids, first) in enumerate(row):
            assert first >= 1, "the first token of an example has nothing to predict it"
            n = len(ids)
            input_ids[r, start : start + n] = torch.tensor(ids, dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            segment[r, start : start + n] = k
            if k:
                segments.append((r, start, n, False))
            sequences.append([(r, start, n)])
            # token t is predicted at the column of token t-1
            pred_rows += [r] * (n - first)
            pred_cols += range(start + first - 1, start + n - 1)
            targets += ids[first:]
            lengths.append(n - first)
            start += n
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    same = segment[:, None, :] == segment[:, :, None]  # [R, Lq, Lk]
    return PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=(causal[None] & same)[:, None],
        predict_rows=torch.tensor(pred_rows, dtype=torch.long),
        predict_cols=torch.tensor(pred_cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        completion_lengths=lengths,
        layout=SegmentLayout.build(width, [len(row[0][0]) if row else 0 for row in rows], segments),
        sequences=SequenceLayout.build(len(rows), width, sequences),
    )
