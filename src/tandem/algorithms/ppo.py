"""PPO maths: KL-penalised token rewards, GAE, masked whitening, clipped policy and value losses.

Pure functions on tensors (DESIGN.md sections 6 and 9); no config, no logging, no process group.
All per-token tensors are [B, T] over completion tokens with a right-padded mask.
"""

from __future__ import annotations

import torch


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards [B, T] (Ziegler et al. 2019; Ouyang et al. 2022): a KL penalty on every
    token plus the sequence score [B] on the last valid token.

      r_t = -kl_coef * (logp_t - logp_ref_t) * m_t  +  score * 1[t == last valid token]
    The rewards are targets: computed without gradient whatever the inputs carry.
    """
    _check_tokens({"logprobs": logprobs, "ref_logprobs": ref_logprobs, "mask": mask})
    if scores.shape != (logprobs.shape[0],):
        raise ValueError(f"scores must be [B] = [{logprobs.shape[0]}], got {tuple(scores.shape)}")
    mask = mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("every row of mask needs at least one valid token to carry its score")
    with torch.no_grad():
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        rewards = -kl_coef * (logprobs.to(dtype) - ref_logprobs.to(dtype)) * mask.to(dtype)
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, -1).max(dim=1).values  # [B]
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, last] += scores.to(dtype)
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns (advantages, returns), [B, T].

      delta_t = r_t + gamma V_{t+1} - V_t
      A_t     = delta_t + gamma lam A_{t+1}
      R_t     = A_t + V_t
    A position with mask 0 ends the episode: V and A beyond the last valid token are 0, so the last
    token's delta is r_t - V_t. Masked positions get 0 advantages and returns. Both outputs are
    targets, computed without gradient.
    """
    _check_tokens({"rewards": rewards, "values": values, "mask": mask})
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    with torch.no_grad():
        dtype = torch.promote_types(values.dtype, torch.float32)
        keep = mask.to(dtype)
        rewards = rewards.to(dtype) * keep
        values = values.to(dtype) * keep
        next_value = torch.zeros_like(values[:, 0])  # [B]
        next_advantage = torch.zeros_like(values[:, 0])
        columns = []
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            # a masked position gives 0 here, so the token before it sees a terminal state
            next_advantage = (delta + gamma * lam * next_advantage) * keep[:, t]
            next_value = values[:, t]
            columns.append(next_advantage)
        advantages = torch.stack(columns[::-1], dim=1)
        returns = (advantages + values) * keep
    return advantages, returns


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    moments: tuple[float, float] | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the kept positions of x [B, T]; masked positions are 0.

    mean and var are the masked mean and population (1/n) variance of this batch, or `moments`
    = (mean, var) when given: those of a larger batch (every micro-batch of every rank, reduced by
    the caller). With shift_mean=False the mean is added back: only the scale changes (for
    advantages whose sign should stay as it was).
    """
    _check_tokens({"x": x, "mask": mask})
    keep = mask.to(x.dtype)
    if moments is not None:
        mean, var = moments
        whitened = (x - mean) * (var + eps) ** -0.5
    else:
        count = keep.sum().clamp(min=1.0)
        mean = (x * keep).sum() / count
        var = ((x - mean) ** 2 * keep).sum() / count
        whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * keep


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate (Schulman et al. 2017); returns (loss, stats), inputs [B, T].

      ratio_t = exp(logp_t - logp_old_t)
      loss    = sum_t m_t max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps, 1 + eps)) / normalizer
    `normalizer` defaults to this batch's number of valid tokens; pass the count of the whole
    optimizer batch (all micro-batches, all ranks) so that accumulation does not change the update.
    Stats (token means over this batch): clip_fraction (the clipped term is the larger one),
    approx_kl = mean (ratio - 1) - log ratio (Schulman's k3 estimate of KL(old || new)), num_tokens.
    """
    _check_tokens(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "mask": mask}
    )
    if clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
    keep = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped) * keep
    loss = per_token.sum() / (normalizer if normalizer is not None else keep.sum().clamp(min=1.0))

    with torch.no_grad():
        num_tokens = keep.sum()
        denom = num_tokens.clamp(min=1.0)
        stats = {
            "clip_fraction": float(((clipped > unclipped).to(keep.dtype) * keep).sum() / denom),
            "approx_kl": float((((ratio - 1.0) - log_ratio) * keep).sum() / denom),
            "num_tokens": float(num_tokens),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss; returns (loss, stats), inputs [B, T].

      V_clip = V_old + clip(V - V_old, -eps, eps)
      loss   = sum_t m_t 0.5 max((V_t - R_t)^2, (V_clip_t - R_t)^2) / normalizer
    `normalizer` as in ppo_policy_loss. Stats: value_clip_fraction (the clipped error is the larger),
    value_mse (unclipped squared error, token mean), num_tokens.
    """
    _check_tokens({"values": values, "old_values": old_values, "returns": returns, "mask": mask})
    if clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
    keep = mask.to(values.dtype)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(error, clipped_error) * keep
    loss = per_token.sum() / (normalizer if normalizer is not None else keep.sum().clamp(min=1.0))

    with torch.no_grad():
        num_tokens = keep.sum()
        denom = num_tokens.clamp(min=1.0)
        stats = {
            "value_clip_fraction": float(((clipped_error > error).to(keep.dtype) * keep).sum() / denom),
            "value_mse": float((error * keep).sum() / denom),
            "num_tokens": float(num_tokens),
        }
    return loss, stats


def _check_tokens(tensors: dict[str, torch.Tensor]) -> None:
    # every per-token input is [B, T] with one shape; name the first one that is not
    names = list(tensors)
    first = tensors[names[0]]
    if first.ndim != 2:
        raise ValueError(f"{names[0]} must be [B, T], got shape {tuple(first.shape)}")
    for name in names[1:]:
        if tensors[name].shape != first.shape:
            raise ValueError(
                f"{name} must have the shape of {names[0]} {tuple(first.shape)}, "
                f"got {tuple(tensors[name].shape)}"
            )
