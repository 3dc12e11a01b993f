"""DPO maths: sequence log-probs, the DPO/IPO loss with a per-pair margin, and the Safe-MM-DPO margin.

Pure functions on tensors (DESIGN.md sections 6 and 9); no config, no logging, no process group.

Safe-MM-DPO (the margin built by `safe_mm_margin`, passed to `dpo_loss(margin=...)`):

    m_i    = w_h (h_c - h_r) + w_s (s_c - s_r) + delta * 1[chosen answer is the safer one]
    loss_i = -log sigma( beta [log pi/pi_ref (y_c) - log pi/pi_ref (y_r)] - m_i )

where h and s are the helpful and harmless reward models' scores of the chosen (c) and rejected (r)
answers, w_h, w_s their weights and delta the safety offset.
Derivation. A Bradley-Terry preference with an offset, p(y_c > y_r) = sigma(r(y_c) - r(y_r) - m),
becomes the loss above once DPO's implicit reward beta log pi/pi_ref is put in for r (the partition
function cancels in the difference): a pair keeps pushing until its implicit reward gap exceeds m.
MODPO reads m as the part of a multi-objective reward r = w_h r_help + w_s r_harm that frozen reward
models already score, folding those models' weighted score gaps into the margin; SafeDPO adds a
further fixed offset delta to the pairs whose chosen answer is the safer one, so that safety
preferences are learnt with a wider gap.
  - "SafeDPO: A Simple Approach to Direct Preference Optimization with Enhanced Safety"
    (Kim et al., 2025).
  - "Beyond One-Preference-Fits-All Alignment: Multi-Objective Direct Preference Optimization"
    (MODPO; Zhou et al., 2024).
  - "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
    (Rafailov et al., 2023); IPO: "A General Theoretical Paradigm to Understand Learning from
    Human Preferences" (Azar et al., 2023).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logps(
    token_logprobs: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Sequence log-probs [B] from token log-probs [B, T] and the tokens to keep `mask` [B, T].

    average=False: sum_t m_t logp_t (DPO's log pi(y|x));
    average=True:  sum_t m_t logp_t / sum_t m_t (length-normalised, as IPO and SimPO use it);
    a row with no kept token gives 0.
    """
    if token_logprobs.shape != mask.shape or token_logprobs.ndim != 2:
        raise ValueError(
            f"token_logprobs and mask must both be [B, T], got {tuple(token_logprobs.shape)} "
            f"and {tuple(mask.shape)}"
        )
    mask = mask.to(token_logprobs.dtype)
    total = (token_logprobs * mask).sum(dim=1)
    if average:
        total = total / mask.sum(dim=1).clamp(min=1.0)
    return total


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    margin: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean DPO (or IPO) loss over the pairs and reward stats; all inputs are sequence log-probs [B].

      logit_diff = (pc - rc) - (pr - rr)            (p: policy, r: reference; c/r: chosen/rejected)
      h          = beta * logit_diff                 (implicit reward gap)
      z          = h - margin                        (margin [B], in reward units; 0 when None)
      sigmoid:   -(1 - ls) log sigma(z) - ls log sigma(-z)   (ls = label_smoothing: conservative DPO)
      ipo:       (z / beta - 1 / (2 beta))**2 = (logit_diff - margin / beta - 1 / (2 beta))**2
    The margin enters both forms the same way, through z: a positive margin raises the implicit
    reward gap a pair is asked for (sigmoid: the loss grows with it; ipo: the regression target for
    h moves from 1/2 to 1/2 + margin). Label smoothing applies to "sigmoid" only.
    Stats: reward_chosen = mean beta (pc - rc), reward_rejected = mean beta (pr - rr),
    reward_margin = mean of their difference, reward_accuracy = fraction with chosen > rejected,
    num_pairs to combine micro-batches.
    """
    tensors = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
    }
    if margin is not None:
        tensors["margin"] = margin
    _check_pairs(tensors)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "ipo" and label_smoothing != 0.0:
        raise ValueError("label_smoothing applies to loss_type='sigmoid' only; set it to 0 for 'ipo'")

    # at least fp32: log sigma of a bf16 reward gap loses most of its digits
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    chosen_logratios = policy_chosen_logps.to(dtype) - ref_chosen_logps.to(dtype)  # [B]
    rejected_logratios = policy_rejected_logps.to(dtype) - ref_rejected_logps.to(dtype)  # [B]
    z = beta * (chosen_logratios - rejected_logratios)
    if margin is not None:
        z = z - margin.to(dtype)
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    else:
        losses = (z / beta - 1.0 / (2.0 * beta)) ** 2
    loss = losses.mean()

    with torch.no_grad():
        reward_chosen = beta * chosen_logratios
        reward_rejected = beta * rejected_logratios
        stats = {
            "reward_chosen": float(reward_chosen.mean()),
            "reward_rejected": float(reward_rejected.mean()),
            "reward_margin": float((reward_chosen - reward_rejected).mean()),
            "reward_accuracy": float((reward_chosen > reward_rejected).to(dtype).mean()),
            "num_pairs": float(z.numel()),
        }
    return loss, stats


def safe_mm_margin(
    helpful_chosen: torch.Tensor,
    helpful_rejected: torch.Tensor,
    harmless_chosen: torch.Tensor,
    harmless_rejected: torch.Tensor,
    *,
    helpful_weight: float = 1.0,
    harmless_weight: float = 1.0,
    safety_margin: float = 0.0,
    chosen_is_safer: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Safe-MM-DPO margin [B] (module docstring) from reward-model scores [B] of each answer.

      m = helpful_weight (helpful_chosen - helpful_rejected)
        + harmless_weight (harmless_chosen - harmless_rejected)
        + safety_margin * 1[chosen_is_safer]
    `chosen_is_safer` [B] (bool) defaults to harmless_chosen > harmless_rejected. The scores come
    from frozen reward models: pass them detached, the margin is a target, not a parameter.
    """
    tensors = {
        "helpful_chosen": helpful_chosen,
        "helpful_rejected": helpful_rejected,
        "harmless_chosen": harmless_chosen,
        "harmless_rejected": harmless_rejected,
    }
    if chosen_is_safer is not None:
        tensors["chosen_is_safer"] = chosen_is_safer
    _check_pairs(tensors)
    if chosen_is_safer is None:
        chosen_is_safer = harmless_chosen > harmless_rejected
    dtype = torch.promote_types(helpful_chosen.dtype, torch.float32)
    helpful_gap = helpful_chosen.to(dtype) - helpful_rejected.to(dtype)
    harmless_gap = harmless_chosen.to(dtype) - harmless_rejected.to(dtype)
    safer = chosen_is_safer.to(dtype)
    return helpful_weight * helpful_gap + harmless_weight * harmless_gap + safety_margin * safer


def _check_pairs(tensors: dict[str, torch.Tensor]) -> None:
    # every per-pair input is [B] with the same B; name the first one that is not
    names = list(tensors)
    first = tensors[names[0]]
    if first.ndim != 1:
        raise ValueError(f"{names[0]} must be [B] (one value per pair), got shape {tuple(first.shape)}")
    for name in names[1:]:
        if tensors[name].shape != first.shape:
            raise ValueError(
                f"{name} must have the shape of {names[0]} {tuple(first.shape)}, "
                f"got {tuple(tensors[name].shape)}"
            )
