"""GRPO maths: group-relative advantages and the clipped policy loss with a k3 KL penalty.

Pure functions on tensors (DESIGN.md sections 6 and 9); no config, no logging, no process group.
"""

from __future__ import annotations

import torch

from tandem.algorithms.logprobs import kl_k3

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
REWARD_SCALINGS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, DeepSeekMath).

    rewards [N] ordered group by group (N = num_groups * group_size) -> advantages [N]:
      group: A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      (the GRPO paper)
      batch: A_i = (r_i - mean_g(r)) / (std_batch(r) + eps)  (group centring, batch scale)
      none:  A_i =  r_i - mean_g(r)                          (Dr. GRPO: no std division)
    std is the unbiased (n - 1) standard deviation, as torch.std; a group whose rewards are
    all equal gets advantage 0 for every member whatever the scaling.
    A NaN reward marks an unscored completion (every reward function returned None): it gets
    advantage 0, and the means and stds above are taken over the scored rewards only (n their
    count), as TRL's GRPOTrainer does (>= 1.6).
    """
    if scale not in REWARD_SCALINGS:
        raise ValueError(f"scale must be one of {REWARD_SCALINGS}, got {scale!r}")
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be [num_groups * {group_size}], got shape {tuple(rewards.shape)}")
    if bool(rewards.isnan().any()):
        return _advantages_of_scored(rewards.float(), group_size, scale, eps)
    grouped = rewards.float().view(-1, group_size)  # [G, n]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = _safe_div(centred, grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = _safe_div(centred, rewards.float().std() + eps)
    return centred.reshape(-1)


def _advantages_of_scored(rewards: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """group_advantages where some rewards are NaN (unscored): the statistics of the others; 0 for them.
    A separate path, so that runs without unscored completions keep their exact arithmetic."""
    grouped = rewards.view(-1, group_size)  # [G, n]
    scored = ~grouped.isnan()
    mean = grouped.nanmean(dim=1, keepdim=True)  # NaN for a group with nothing scored: masked below
    centred = torch.where(scored, grouped - mean, torch.zeros_like(grouped))
    if scale == "group":
        count = scored.sum(dim=1, keepdim=True)
        # one scored member: 0 / 0, but its centred value is 0, which _safe_div keeps
        std = (centred.square().sum(dim=1, keepdim=True) / (count - 1)).sqrt()
        centred = _safe_div(centred, std + eps)
    elif scale == "batch":
        centred = _safe_div(centred, rewards[~rewards.isnan()].std() + eps)
    return centred.reshape(-1)


def _safe_div(centred: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # a flat group has centred == 0: keep it 0 even when eps == 0 makes the scale 0
    return torch.where(centred == 0, torch.zeros_like(centred), centred / scale)


def grpo_loss(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.04,
    loss_agg: str = "seq-mean-token-mean",
    normalizer: float | None = None,
    max_completion_length: int | None = None,
    importance_weights: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate minus a k3 KL penalty, aggregated as `loss_agg`; returns (loss, stats).

    Shapes: log-probs, completion_mask and importance_weights [B, T] over completion tokens,
    advantages [B]. `sampler_logprobs` is pi_old, whichever process computed it.
      ratio_t = exp(logp_new - logp_old)
      obj_t   = w_t * min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A) - kl_coef * KL_t
      KL_t    = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1        (Schulman's k3, >= 0)
      w_t     = importance_weights (held constant; see truncated_importance_weights), 1 when None
    Aggregations of -obj_t (m = completion_mask):
      seq-mean-token-mean      sum_i [sum_t m obj / sum_t m] / normalizer   (normalizer = #sequences)
      token-mean               sum_{i,t} m obj / normalizer                  (normalizer = #tokens; DAPO)
      seq-mean-token-sum-norm  sum_{i,t} m obj / (normalizer * L)            (Dr. GRPO; L = max_completion_length)
    `normalizer` defaults to this batch's own count; pass the count of the whole optimizer
    batch (all micro-batches, all ranks) so that gradient accumulation and world size do not
    change the update. `ref_logprobs` may be None when kl_coef == 0.
    `importance_sampling_level="sequence"` is GSPO (Zheng et al. 2025): ratio_t is replaced by the
    sequence ratio of `sequence_importance_ratio`, the same value on every token of a sequence; the KL
    term and the aggregation stay per token.
    The stats are means over this batch with the counts to combine them: kl, ratio_mean and
    ratio_abs_dev over `num_tokens` tokens; clip_fraction (= clip_ratio_low + clip_ratio_high;
    low: ratio < 1 - eps_low with A < 0, high: ratio > 1 + eps_high with A > 0) over tokens, or under
    GSPO over the `num_sequences` sequences that have a token in the mask.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {loss_agg!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {importance_sampling_level!r}"
        )
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_coef != 0")
    mask = completion_mask.to(trainer_logprobs.dtype)
    adv = advantages.to(trainer_logprobs.dtype).unsqueeze(1)  # [B, 1]

    if importance_sampling_level == "sequence":
        ratio = sequence_importance_ratio(trainer_logprobs, sampler_logprobs, completion_mask)
    else:
        ratio = torch.exp(trainer_logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    if importance_weights is not None:
        objective = importance_weights.detach().to(objective.dtype) * objective
    if kl_coef != 0:
        kl = kl_k3(trainer_logprobs, ref_logprobs)
        objective = objective - kl_coef * kl
    else:
        kl = torch.zeros_like(trainer_logprobs)

    per_token = -objective * mask
    if loss_agg == "seq-mean-token-mean":
        per_seq = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        loss = per_seq.sum() / (normalizer if normalizer is not None else mask.shape[0])
    elif loss_agg == "token-mean":
        loss = per_token.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1.0))
    else:
        length = max_completion_length if max_completion_length is not None else mask.shape[1]
        loss = per_token.sum() / ((normalizer if normalizer is not None else mask.shape[0]) * length)

    with torch.no_grad():
        num_tokens = mask.sum()
        denom = num_tokens.clamp(min=1.0)
        is_low = (ratio < 1.0 - clip_eps_low) & (adv < 0)
        is_high = (ratio > 1.0 + clip_eps_high) & (adv > 0)
        has_tokens = mask.sum(dim=1) > 0  # [B]
        num_sequences = has_tokens.sum()
        if importance_sampling_level == "sequence":
            # one ratio per sequence: the fractions count sequences (those with a token in the mask)
            seq_denom = num_sequences.clamp(min=1).to(mask.dtype)
            low = float((is_low[:, 0] & has_tokens).sum() / seq_denom) if mask.shape[1] else 0.0
            high = float((is_high[:, 0] & has_tokens).sum() / seq_denom) if mask.shape[1] else 0.0
            clip_fraction = low + high  # disjoint: the advantage's sign tells them apart
        else:
            low = float((is_low.to(mask.dtype) * mask).sum() / denom)
            high = float((is_high.to(mask.dtype) * mask).sum() / denom)
            clip_fraction = float(((is_low | is_high).to(mask.dtype) * mask).sum() / denom)
        stats = {
            "kl": float((kl * mask).sum() / denom),
            "clip_fraction": clip_fraction,
            "clip_ratio_low": low,
            "clip_ratio_high": high,
            "ratio_mean": float((ratio * mask).sum() / denom),
            "ratio_abs_dev": float(((ratio - 1.0).abs() * mask).sum() / denom),
            "num_tokens": float(num_tokens),
            "num_sequences": float(num_sequences),
        }
    return loss, stats


def sequence_importance_ratio(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization"), in the token form that carries its gradient to every token (GSPO-token):
      s_i   = exp( (1/|y_i|) sum_t m_it (logp_new_it - logp_old_it) ),   |y_i| = sum_t m_it
      s_i,t = sg[s_i] * pi_new(y_it) / sg[pi_new(y_it)]                   (sg: stop-gradient)
    Every token of sequence i carries the value s_i and d s_i,t = s_i * d logp_new_it, so with one
    advantage per sequence the clipped objective's gradient is GSPO's own. A sequence with no token
    in the mask gets s_i = 1. [B, T] -> [B, T].
    """
    mask = completion_mask.to(trainer_logprobs.dtype)
    log_ratio = (trainer_logprobs - sampler_logprobs) * mask
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return torch.exp(seq_log_ratio.detach() + trainer_logprobs - trainer_logprobs.detach())


def gspo_loss(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): `grpo_loss` with the sequence ratio s_i of `sequence_importance_ratio`,
      obj_i,t = min(s_i,t A_i, clip(s_i,t, 1 - eps_low, 1 + eps_high) A_i) - kl_coef KL_t
    aggregated as `loss_agg`. The paper clips far tighter than token-level GRPO (eps_low 3e-4,
    eps_high 4e-4): a sequence ratio is a geometric mean of token ratios, so it stays near 1.
    `options` are grpo_loss's keyword arguments."""
    return grpo_loss(
        trainer_logprobs,
        sampler_logprobs,
        ref_logprobs,
        advantages,
        completion_mask,
        importance_sampling_level="sequence",
        **options,
    )


def truncated_importance_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling of Yao et al. 2025 ("Your efficient RL framework secretly brings
    you off-policy RL training"): the tokens were drawn by the sampler's engine, whose log-probs
    differ from the trainer's for the same weights, so each token's surrogate is reweighted by
      w_t = min(exp(logp_old - logp_sampler), cap)
    with logp_old the trainer's own log-probs of pi_old. [B, T] -> [B, T], no gradient.
    """
    return torch.exp(old_logprobs - sampler_logprobs).clamp(max=cap).detach()
