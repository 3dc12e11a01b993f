"""Reward-model maths: the Bradley-Terry pairwise loss on chosen/rejected scores and its accuracy, and
the Safe-RLHF cost model's classification term on answers labelled safe or unsafe.

Pure functions on tensors (DESIGN.md sections 6 and 9); no config, no logging, no process group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, *, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Bradley-Terry loss: mean_i -log sigma(chosen_i - rejected_i - margin_i); scores and margin [B].

    `margin` (Llama 2, Touvron et al. 2023) asks for a score gap of at least margin_i on pairs
    rated far apart; it is subtracted inside the sigmoid, so a positive margin raises the loss.
    F.logsigmoid keeps the loss finite for any score gap (log(sigmoid(x)) underflows to -inf
    for x below about -100 in fp32).
    """
    if chosen_scores.ndim != 1 or chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"chosen_scores and rejected_scores must both be [B], got {tuple(chosen_scores.shape)} "
            f"and {tuple(rejected_scores.shape)}"
        )
    if margin is not None and margin.shape != chosen_scores.shape:
        raise ValueError(
            f"margin must have the shape of chosen_scores {tuple(chosen_scores.shape)}, "
            f"got {tuple(margin.shape)}"
        )
    dtype = torch.promote_types(chosen_scores.dtype, torch.float32)
    gap = chosen_scores.to(dtype) - rejected_scores.to(dtype)  # [B]
    if margin is not None:
        gap = gap - margin.to(dtype)
    return -F.logsigmoid(gap).mean()


def pairwise_accuracy(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> float:
    """Fraction of pairs whose chosen score is strictly above the rejected one (a tie is a miss)."""
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(
            f"chosen_scores and rejected_scores must have one shape, got {tuple(chosen_scores.shape)} "
            f"and {tuple(rejected_scores.shape)}"
        )
    if chosen_scores.numel() == 0:
        raise ValueError("pairwise_accuracy needs at least one pair, got empty scores")
    return float((chosen_scores > rejected_scores).float().mean())


def cost_classification_loss(scores: torch.Tensor, is_safe: torch.Tensor) -> torch.Tensor:
    """The classification term of Safe-RLHF's cost-model loss (Dai et al. 2023, arXiv:2310.12773) on
    the harmless score S = -C (higher = safer): the mean over the N labelled answers of -log sigma(S)
    for a safe answer and -log sigma(-S) for an unsafe one; scores [N] float, is_safe [N] bool.

    It pins the score's sign, not just the order of a pair: S > 0 comes to mean safe, which the
    pairwise loss alone leaves free (a constant added to every score does not change it). The mean is
    over answers, so a pair with both answers labelled counts twice: where every pair is, it equals the
    average of the chosen and the rejected means (the Safe-MM-DPO origin's reduction) and half the
    paper's per-pair sum of the two terms.
    """
    if scores.ndim != 1 or is_safe.shape != scores.shape:
        raise ValueError(
            f"scores and is_safe must both be [N], got {tuple(scores.shape)} and {tuple(is_safe.shape)}"
        )
    if is_safe.dtype != torch.bool:
        raise ValueError(f"is_safe must be a bool tensor (True = safe), got {is_safe.dtype}")
    if scores.numel() == 0:
        raise ValueError("cost_classification_loss needs at least one labelled answer, got empty scores")
    dtype = torch.promote_types(scores.dtype, torch.float32)
    signed = torch.where(is_safe, scores.to(dtype), -scores.to(dtype))  # [N]: > 0 when the sign is right
    return -F.logsigmoid(signed).mean()
