"""Supervised fine-tuning maths: the masked next-token negative log-likelihood.

Pure functions on tensors (DESIGN.md section 6); no config, no logging, no process group.
"""

from __future__ import annotations

import torch


def sft_loss(
    token_logprobs: torch.Tensor, loss_mask: torch.Tensor, *, normalizer: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = -sum_{b,t} mask[b,t] * logp[b,t] / normalizer; log-probs and mask [B, T].

    `normalizer` is the number of loss tokens the mean is taken over: under gradient accumulation
    and data parallelism, the GLOBAL count of the whole optimizer batch (every micro-batch of every
    rank), so that summing the micro-batches' gradients gives the token mean of the batch whatever
    its cut. Default: this batch's own count (a plain token mean). stats: `num_tokens` (this
    batch's loss tokens), `nll_sum` and `nll` (this batch's token-mean NLL, 0 when it has none).
    """
    if token_logprobs.shape != loss_mask.shape or token_logprobs.ndim != 2:
        raise ValueError(
            f"token_logprobs and loss_mask must both be [B, T], got {tuple(token_logprobs.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(torch.promote_types(token_logprobs.dtype, torch.float32))
    nll_sum = -(token_logprobs.to(mask.dtype) * mask).sum()
    num_tokens = float(mask.sum())
    if normalizer is None:
        normalizer = max(num_tokens, 1.0)  # a batch without loss tokens contributes 0, not NaN
    elif normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (a count of loss tokens), got {normalizer}")
    nll = float(nll_sum.detach())
    stats = {"num_tokens": num_tokens, "nll_sum": nll, "nll": nll / num_tokens if num_tokens else 0.0}
    return nll_sum / normalizer, stats
