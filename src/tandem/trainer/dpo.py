"""The DPO loop, and Safe-MM-DPO: preference pairs against a frozen reference, one optimizer step at a time.

Run: `tandem dpo configs/dpo_tiny.yaml` (Safe-MM-DPO: configs/safe_mm_dpo_tiny.yaml; several ranks:
torchrun ... -m tandem.cli dpo CONFIG). The maths is algorithms/dpo.py; this file feeds it, and keeps
Safe-MM-DPO's Lagrange multiplier (variant lagrangian): one number, updated after every optimizer step
from rank-summed quantities (so identical on every rank) and saved in each checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.algorithms.dpo import (
    dpo_loss,
    lagrange_update,
    preferred_cost,
    safe_mm_dpo_loss,
    safe_mm_margin,
    sequence_logps,
)
from tandem.config import Config, ConfigError, TrainingConfig
from tandem.data.preferences import EncodedPair, PreferencePair, encode_pair, load_preferences
from tandem.distributed.batches import rank_micro_batches
from tandem.distributed.engine import build_engine, frozen_forward
from tandem.distributed.env import DistEnv, all_reduce_dict, all_reduce_sum
from tandem.distributed.runtime import autocast
from tandem.models.forward import pack_rows
from tandem.models.loading import check_same_tokenizer, load_tokenizer
from tandem.models.lora import BaseOfAdapter, is_lora
from tandem.models.reward import RewardScorer
from tandem.rewards.model import INFO_FILE
from tandem.trainer import run
from tandem.trainer.run import export_final, load_policy, open_run, run_distributed

log = logging.getLogger(__name__)


@dataclass
class PairData:
    """Encoded pairs and what stays fixed while the policy trains, indexed like `pairs`."""

    pairs: list[EncodedPair]
    pad_id: int  # the token that pads packed rows (never scored)
    ref_logps: torch.Tensor | None = None  # [N, 2] reference log-probs (chosen, rejected); None = online
    margins: torch.Tensor | None = None  # [N] Safe-MM-DPO margins (variant margin); None otherwise
    # Safe-MM-DPO variant lagrangian: the reward models' scores [N, 2] (chosen, rejected); None otherwise
    helpful: torch.Tensor | None = None
    harmless: torch.Tensor | None = None  # S: > 0 safe; the cost is -S

    @property
    def lagrangian(self) -> bool:
        return self.harmless is not None


@dataclass
class Lagrange:
    """Safe-MM-DPO's multiplier and its smoothed cost J_C (None before the first step)."""

    lam: float
    cost_ema: float | None = None

    def update(self, expected_cost: float, sm) -> None:
        """After an optimizer step: J_C (the batch's expected cost + threshold) into the EMA, then
        lagrange_update. A non-finite cost (a step whose loss was not finite) changes nothing."""
        if not math.isfinite(expected_cost):
            return
        batch = expected_cost + sm.cost_threshold
        if self.cost_ema is None:
            self.cost_ema = batch
        else:
            self.cost_ema = sm.cost_ema_decay * self.cost_ema + (1.0 - sm.cost_ema_decay) * batch
        self.lam = lagrange_update(
            self.lam, self.cost_ema, lr=sm.lambda_lr, lambda_min=sm.lambda_min, lambda_max=sm.lambda_max
        )

    def state(self) -> dict:
        return {"safe_mm_lambda": self.lam, "safe_mm_cost_ema": self.cost_ema}

    def restore(self, saved: dict) -> None:
        if "safe_mm_lambda" not in saved:
            raise ConfigError(
                "training.resume_from_checkpoint: the checkpoint holds no Safe-MM-DPO multiplier "
                "(written by another dpo variant); resume with the config that wrote it"
            )
        self.lam, self.cost_ema = saved["safe_mm_lambda"], saved["safe_mm_cost_ema"]


def train_dpo(cfg: Config) -> Path:
    """Train, evaluate, checkpoint and export; returns the folder of the final HF model.

    Before the first step: the reward models (Safe-MM-DPO) score every pair once and are freed;
    with dpo.reference_logps=precompute the reference's log-probs of every pair are computed once
    too (and that reference freed); with `online` the reference runs on each micro-batch.
    Under torchrun every rank runs this; rank 0 alone logs and writes."""
    return run_distributed(cfg, _train)


def _train(cfg: Config, env: DistEnv, device: torch.device) -> Path:
    check_config(cfg)
    run_dir, tc = cfg.run_dir, cfg.training
    checkpoints_dir = run_dir / "checkpoints"
    resume_path = open_run(cfg, env)
    tokenizer, policy = load_policy(cfg, env, device)
    engine = build_engine(policy, tc, env, device)
    # before any update and before a resumed checkpoint is loaded: the policy is still the initial one
    train, evals, reference = prepare(cfg, engine, tokenizer, env, device)

    batch_size = tc.micro_batch_size * tc.gradient_accumulation_steps * env.world_size
    steps_per_epoch = run.batches_per_epoch(len(train.pairs), batch_size, "pairs")
    total_steps = min(tc.max_steps, tc.num_epochs * steps_per_epoch)
    # the data position is the step: batches are a function of (seed, epoch), checked on resume
    data_state = {"num_train_pairs": len(train.pairs), "batch_size": batch_size}
    lagrange = Lagrange(cfg.dpo.safe_mm.lambda_init) if train.lagrangian else None
    restore = lagrange.restore if lagrange is not None else None
    step = run.resume_data_loop(resume_path, engine, env, data_state, restore)
    logger = run.data_loop_logger(cfg, env, step)
    bar = tqdm(total=total_steps, initial=step, desc="dpo", dynamic_ncols=True, disable=not env.is_main)
    last_saved = step
    batches: tuple[int, list[list[int]]] = (-1, [])  # (epoch, its batches of pair indices)
    try:
        while step < total_steps:
            row_start = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            if batches[0] != epoch:
                batches = (
                    epoch,
                    run.epoch_batches(len(train.pairs), batch_size, epoch, cfg.seed, cfg.data.shuffle, "dpo"),
                )
            stats = optimizer_step(engine, train, batches[1][index], reference, cfg, env, device, lagrange)
            step += 1
            row = {"step": step, "epoch": step / steps_per_epoch, **stats}
            row["step_seconds"] = time.perf_counter() - row_start
            if env.world_size > 1:
                row["world_size"] = env.world_size
            if evals.pairs and (step == total_steps or (tc.eval_steps and step % tc.eval_steps == 0)):
                row.update(evaluate(engine, evals, reference, cfg, env, device, lagrange))
            if env.is_main:
                if step % tc.logging_steps == 0 or step == total_steps or "eval_loss" in row:
                    logger.log(row)
                bar.update(1)
                postfix = {"loss": f"{row['loss']:.4f}", "acc": f"{row['reward_accuracy']:.2f}"}
                if lagrange is not None:
                    postfix["lambda"] = f"{lagrange.lam:.4g}"
                bar.set_postfix(postfix)
            if tc.save_steps and step % tc.save_steps == 0:
                state = {**data_state, **(lagrange.state() if lagrange is not None else {})}
                run.save(checkpoints_dir, step, engine, env, None, tokenizer, state, tc.save_total_limit)
                last_saved = step
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    if last_saved != step:
        state = {**data_state, **(lagrange.state() if lagrange is not None else {})}
        run.save(checkpoints_dir, step, engine, env, None, tokenizer, state, tc.save_total_limit)
    return export_final(engine, env, tokenizer, run_dir / "final")


def prepare(cfg: Config, engine, tokenizer, env: DistEnv, device: torch.device):
    """(train, eval, reference): the encoded pairs with everything fixed before the first step. The
    reward models score every pair once (Safe-MM-DPO); with `precompute` the reference's log-probs
    are computed once and the returned reference is None (freed), else it runs per micro-batch."""
    train_raw, eval_raw = load_pairs(cfg)
    pad_id = tokenizer.pad_token_id
    train = PairData([encode_pair(tokenizer, p, cfg.dpo.max_length) for p in train_raw], pad_id)
    evals = PairData([encode_pair(tokenizer, p, cfg.dpo.max_length) for p in eval_raw], pad_id)
    t0 = time.perf_counter()
    if cfg.dpo.safe_mm.enabled:
        if cfg.dpo.safe_mm.variant == "lagrangian" and env.is_main:
            warn_if_not_a_cost_model(cfg.dpo.safe_mm.harmless_model)
        # each reward model is loaded once and scores the train and the eval pairs
        scored = reward_scores(cfg, [train_raw, eval_raw], env, device)
        for data, raw, (helpful, harmless) in zip((train, evals), (train_raw, eval_raw), scored):
            if not raw:
                continue
            if cfg.dpo.safe_mm.variant == "lagrangian":
                data.helpful, data.harmless = helpful, harmless
            else:
                data.margins = margins_of(cfg, raw, helpful, harmless)
    reference = build_reference(cfg, engine, tokenizer, env, device)
    if cfg.dpo.reference_logps == "precompute":
        with reference_forward(reference, engine) as forward:
            train.ref_logps = precompute_ref_logps(forward, train, cfg.training, env, device)
            if evals.pairs:
                evals.ref_logps = precompute_ref_logps(forward, evals, cfg.training, env, device)
        reference = None  # training needs only the numbers
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if env.is_main:
        log.info(
            "%d train, %d eval pairs ready in %.1fs",
            len(train.pairs),
            len(evals.pairs),
            time.perf_counter() - t0,
        )
    return train, evals, reference


def warn_if_not_a_cost_model(path: str) -> None:
    """Variant lagrangian reads the harmless model's score S as a cost C = -S with 0 as the line
    between safe and unsafe; a model trained on pairs alone (no safety labels) has no such zero."""
    info = Path(path).expanduser() / INFO_FILE
    if info.is_file() and json.loads(info.read_text()).get("classification_loss_weight") is None:
        log.warning(
            "dpo.safe_mm.harmless_model %s was trained without safety labels (no classification term): "
            "its scores have no zero point, so the sign of the cost J_C, and which way lambda moves, "
            "depend on its offset; train it with labelled data (README: the cost model) or set "
            "dpo.safe_mm.cost_threshold to its score of a borderline answer",
            path,
        )


def check_config(cfg: Config) -> None:
    sm = cfg.dpo.safe_mm
    for key, path, task in (
        ("helpful_model", sm.helpful_model, "helpful"),
        ("harmless_model", sm.harmless_model, "harmless"),
    ):
        if path is not None and not (Path(path).expanduser() / "config.json").is_file():
            raise ConfigError(
                f"`dpo.safe_mm.{key}` is {path!r}, which is not a model folder; train it first with "
                f"`tandem rm configs/rm_{task}.yaml` and give its final/ folder"
            )
    if cfg.model.reference_offload and cfg.dpo.reference_logps == "online":
        raise ConfigError(
            "`model.reference_offload` with dpo.reference_logps=online would reload the reference for "
            "every micro-batch; set dpo.reference_logps=precompute, which frees the reference before training"
        )


# --------------------------------------------------------------------------- data


def load_pairs(cfg: Config) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, eval) preference pairs. Eval: data.eval_dataset, else the held-out "test" split of a
    synthetic or hub set; a local training file without eval_dataset gets no eval."""
    d = cfg.data
    train = load_preferences(
        d.dataset, d.split, task=cfg.dpo.task, num_examples=d.num_examples, seed=cfg.seed
    )
    source = d.eval_dataset
    if source is None and not Path(d.dataset).expanduser().exists():
        source = d.dataset
    if source is None or d.num_eval_examples == 0:
        return train, []
    evals = load_preferences(
        source, "test", task=cfg.dpo.task, num_examples=d.num_eval_examples, seed=cfg.seed
    )
    return train, evals


# --------------------------------------------------------------------------- forwards


def pair_logps(
    forward, pairs: list[EncodedPair], pad_id: int, tc: TrainingConfig, device: torch.device
) -> torch.Tensor:
    """Sequence log-probs [n, 2] (chosen, rejected): each pair is one packed row
    [prompt | chosen | rejected], its prompt computed once and each answer seeing only the prompt."""
    packed = pack_rows([(p.prompt_ids, [p.chosen_ids, p.rejected_ids]) for p in pairs], pad_id).to(device)
    with autocast(device, tc.mixed_precision):
        token_logprobs = forward(packed)  # [2n, T]
    lengths = torch.tensor(packed.completion_lengths, device=token_logprobs.device)
    positions = torch.arange(token_logprobs.shape[1], device=token_logprobs.device)
    return sequence_logps(token_logprobs, positions[None, :] < lengths[:, None]).view(-1, 2)


def build_reference(cfg: Config, engine, tokenizer, env: DistEnv, device: torch.device):
    """The frozen reference. LoRA without model.reference: the base under the adapters (BaseOfAdapter,
    no second copy). Otherwise model.reference, else the initial policy: the policy itself (None)
    when log-probs are precomputed before the first update, a frozen eval-mode copy loaded from
    model.policy when they are computed online, as a forward (frozen_forward: under ZeRO-3 it is
    loaded sharded like the policy)."""
    if is_lora(engine.module) and not cfg.model.reference:
        return BaseOfAdapter(engine.module)
    if cfg.model.reference:
        check_same_tokenizer(
            tokenizer, load_tokenizer(cfg.model.reference, trust_remote_code=cfg.model.trust_remote_code)
        )
    elif cfg.dpo.reference_logps == "precompute":
        return None
    spec = cfg.model.reference or cfg.model.policy
    model = run.load_model(cfg.model, cfg.training, env, device, spec, trainable=False)
    return frozen_forward(model, cfg.training, env)


@contextlib.contextmanager
def reference_forward(reference, engine):
    """The reference as forward(packed) -> token log-probs, without gradients. The policy itself or
    its base runs through engine.model in eval mode (DDP and ZeRO-3 see the forward)."""
    with torch.no_grad():
        if reference is not None and not isinstance(reference, BaseOfAdapter):
            yield reference
            return
        was_training = engine.model.training
        engine.model.eval()
        try:
            with reference if reference is not None else contextlib.nullcontext():
                yield engine.model
        finally:
            engine.model.train(was_training)


def precompute_ref_logps(
    forward, data: PairData, tc: TrainingConfig, env: DistEnv, device: torch.device
) -> torch.Tensor:
    """Reference log-probs [N, 2] of every pair: rank r computes pairs r, r + W, ..., the sum over
    ranks (each pair non-zero on one rank only, float64: exact) fills in the rest."""
    out = torch.zeros(len(data.pairs), 2, dtype=torch.float64)
    for micro, weight in rank_micro_batches(list(range(len(data.pairs))), tc.micro_batch_size, env):
        logps = pair_logps(forward, [data.pairs[i] for i in micro], data.pad_id, tc, device)
        if weight:
            out[micro] = logps.double().cpu()
    return torch.tensor(all_reduce_sum(env, out.flatten().tolist()), dtype=torch.float32).view(-1, 2)


def reward_scores(
    cfg: Config, sets: list[list[PreferencePair]], env: DistEnv, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each set of pairs, (helpful, harmless) scores [N, 2] (chosen, rejected) of every pair; a
    model that is not set scores 0. Each frozen reward model is loaded once, in eval mode, scores
    every chosen and rejected answer of each set (rank r: pairs r, r + W, ...; the rank sum in
    float64 fills in the rest, the same on every rank), and is freed before the next."""
    sm = cfg.dpo.safe_mm
    scores: dict[str, list[torch.Tensor]] = {}
    for name, path in (("helpful", sm.helpful_model), ("harmless", sm.harmless_model)):
        scorer = None
        if path is not None:
            scorer = RewardScorer(
                path,
                device=device,
                dtype=cfg.model.dtype,
                batch_size=2 * cfg.training.micro_batch_size,
                max_length=cfg.dpo.max_length,
            )
        scores[name] = [_set_scores(scorer, pairs, env) for pairs in sets]
        del scorer
        gc.collect()
    return list(zip(scores["helpful"], scores["harmless"]))


def _set_scores(scorer: RewardScorer | None, pairs: list[PreferencePair], env: DistEnv) -> torch.Tensor:
    num = len(pairs)
    mine = list(range(env.rank, num, env.world_size))
    local = torch.zeros(num, 2, dtype=torch.float64)
    if scorer is not None and mine:
        prompts = [pairs[i].prompt for i in mine for _ in range(2)]
        answers = [a for i in mine for a in (pairs[i].chosen, pairs[i].rejected)]
        local[mine] = scorer.score(prompts, answers).double().view(-1, 2)
    return torch.tensor(all_reduce_sum(env, local.flatten().tolist()), dtype=torch.float32).view(-1, 2)


def margins_of(
    cfg: Config, pairs: list[PreferencePair], helpful: torch.Tensor, harmless: torch.Tensor
) -> torch.Tensor:
    """Variant margin's per-pair margins [N] (algorithms/dpo.py safe_mm_margin). chosen_is_safer comes
    from the data; where the data does not say, from the harmless model's scores (none: not safer)."""
    sm = cfg.dpo.safe_mm
    safer = torch.tensor(
        [
            p.chosen_is_safer if p.chosen_is_safer is not None else bool(harmless[i, 0] > harmless[i, 1])
            for i, p in enumerate(pairs)
        ],
        dtype=torch.bool,
    )
    return safe_mm_margin(
        helpful[:, 0],
        helpful[:, 1],
        harmless[:, 0],
        harmless[:, 1],
        helpful_weight=1.0 if sm.helpful_weight is None else sm.helpful_weight,
        harmless_weight=1.0 if sm.harmless_weight is None else sm.harmless_weight,
        safety_margin=0.0 if sm.safety_margin is None else sm.safety_margin,
        chosen_is_safer=safer,
    )


# --------------------------------------------------------------------------- steps


def micro_batch_loss(
    engine, data: PairData, micro: list[int], reference, cfg: Config, device, lagrange: Lagrange | None
):
    """(loss mean over the micro-batch, stats): dpo_loss, or safe_mm_dpo_loss with the multiplier as it
    stands; Safe-MM-DPO's stats add expected_cost, the micro-batch's mean cost under the policy's
    preference between its answers (algorithms/dpo.py preferred_cost; no gradient)."""
    pairs = [data.pairs[i] for i in micro]
    if data.ref_logps is not None:
        ref = data.ref_logps[micro].to(device)
    else:
        with reference_forward(reference, engine) as forward:
            ref = pair_logps(forward, pairs, data.pad_id, cfg.training, device)
    policy = pair_logps(engine.model, pairs, data.pad_id, cfg.training, device)
    if not data.lagrangian:
        margin = data.margins[micro].to(device) if data.margins is not None else None
        return dpo_loss(
            policy[:, 0],
            policy[:, 1],
            ref[:, 0],
            ref[:, 1],
            beta=cfg.dpo.beta,
            margin=margin,
            label_smoothing=cfg.dpo.label_smoothing,
            loss_type=cfg.dpo.loss_type,
        )
    sm = cfg.dpo.safe_mm
    helpful, harmless = data.helpful[micro].to(device), data.harmless[micro].to(device)
    loss, stats = safe_mm_dpo_loss(
        policy[:, 0],
        policy[:, 1],
        ref[:, 0],
        ref[:, 1],
        helpful[:, 0] - helpful[:, 1],
        harmless[:, 0] - harmless[:, 1],
        lam=lagrange.lam,
        beta=cfg.dpo.beta,
        w=sm.w,
        k=sm.k,
    )
    with torch.no_grad():
        lengths = torch.tensor(
            [[len(p.chosen_ids), len(p.rejected_ids)] for p in pairs], dtype=policy.dtype, device=device
        ).clamp(min=1)
        mean_logps = policy.detach() / lengths
        cost = preferred_cost(mean_logps[:, 0], mean_logps[:, 1], -harmless[:, 0], -harmless[:, 1])
    stats["expected_cost"] = float(cost.mean())
    return loss, stats


_PAIR_MEANS = ("reward_chosen", "reward_rejected", "reward_accuracy")
_LAGRANGIAN_MEANS = (
    "loss_helpful",
    "loss_harmless",
    "beta_helpful_mean",
    "beta_harmless_mean",
    "expected_cost",
)


def pair_sums(loss: torch.Tensor, stats: dict, data: PairData, micro: list[int]) -> dict[str, float]:
    """A micro-batch's sums over its pairs of what a row reports, to add across micro-batches and
    ranks before dividing by the pair count `num`."""
    n = len(micro)
    names = _PAIR_MEANS + (_LAGRANGIAN_MEANS if data.lagrangian else ())
    means = {"loss": float(loss.detach()), **{k: stats[k] for k in names}}
    sums = {k: m * n for k, m in means.items()}
    if data.margins is not None:
        sums["margin_mean"] = float(data.margins[micro].sum())
    return {**sums, "num": n}


def no_sums(data: PairData) -> dict[str, float]:
    names = ("loss", *_PAIR_MEANS, "num")
    if data.lagrangian:
        names += _LAGRANGIAN_MEANS
    if data.margins is not None:
        names += ("margin_mean",)
    return dict.fromkeys(names, 0.0)


def add_sums(sums: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {k: sums[k] + more[k] for k in sums}


def row_means(env: DistEnv, sums: dict[str, float], prefix: str = "") -> dict:
    """The rank-summed `sums` as means over the pairs."""
    totals = all_reduce_dict(env, sums)
    num = max(totals.pop("num"), 1.0)
    means = {f"{prefix}{key}": value / num for key, value in totals.items()}
    means[f"{prefix}reward_margin"] = means[f"{prefix}reward_chosen"] - means[f"{prefix}reward_rejected"]
    return means


def optimizer_step(
    engine,
    data: PairData,
    batch: list[int],
    reference,
    cfg: Config,
    env: DistEnv,
    device,
    lagrange: Lagrange | None = None,
) -> dict:
    """One optimizer step on a global batch of pairs; each micro-batch's mean loss is scaled by its
    share of the GLOBAL pair count, so the summed gradients are the batch mean at any world size.
    Safe-MM-DPO (lagrangian): then the multiplier's update from the batch's expected cost (summed over
    ranks, so every rank computes the same lambda); the row holds lambda and cost_ema after it."""
    micro_batches = rank_micro_batches(batch, cfg.training.micro_batch_size, env)
    engine.model.train()
    lr = engine.lr()
    sums = no_sums(data)
    for i, (micro, weight) in enumerate(micro_batches):
        with engine.accumulate(last=i == len(micro_batches) - 1):
            loss, stats = micro_batch_loss(engine, data, micro, reference, cfg, device, lagrange)
            engine.backward(loss * (weight * len(micro) / len(batch)))
        if weight:
            sums = add_sums(sums, pair_sums(loss, stats, data, micro))
    grad_norm = engine.step()
    row = row_means(env, sums)
    if lagrange is not None:
        lagrange.update(row["expected_cost"], cfg.dpo.safe_mm)
        row["lambda"], row["cost_ema"] = lagrange.lam, lagrange.cost_ema
    return {
        **row,
        "grad_norm": grad_norm,
        "skipped_nonfinite": engine.skips.last_skipped,
        "lr": lr,
        "num_pairs": len(batch),
    }


def evaluate(
    engine, data: PairData, reference, cfg: Config, env: DistEnv, device, lagrange: Lagrange | None = None
) -> dict:
    """eval_loss, eval_reward_accuracy, eval_reward_margin, ... over the held-out pairs (every rank
    takes a strided part, in eval mode, without gradients)."""
    t0 = time.perf_counter()
    sums = no_sums(data)
    engine.model.eval()
    with torch.no_grad():
        for micro, weight in rank_micro_batches(
            list(range(len(data.pairs))), cfg.training.micro_batch_size, env
        ):
            loss, stats = micro_batch_loss(engine, data, micro, reference, cfg, device, lagrange)
            if weight:
                sums = add_sums(sums, pair_sums(loss, stats, data, micro))
    engine.model.train()
    return {**row_means(env, sums, "eval_"), "eval_seconds": time.perf_counter() - t0}
