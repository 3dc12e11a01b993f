"""Reward-model maths: the Bradley-Terry pairwise loss on chosen/rejected scores and its accuracy.

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
