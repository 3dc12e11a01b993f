"""DPO maths: sequence log-probs, the DPO/IPO loss with a per-pair margin, and Safe-MM-DPO's two forms.

Pure functions on tensors (DESIGN.md sections 6 and 9); no config, no logging, no process group.

Safe-MM-DPO, variant `lagrangian` (the authors' method: NephrenLuca/mmdpo-alignment, report.md and
src/training/train_safe_mm_dpo.py; MM-DPO's dynamic beta from MM-RLHF, arXiv:2502.10391; the
Lagrange multiplier from Safe RLHF, arXiv:2310.12773). With d = (pc - rc) - (pr - rr), the policy's
log-ratio gap over the reference's (sequence log-probs of the answer tokens), and the reward models'
margins delta_H = H(y_c) - H(y_r) (helpful) and delta_S = S(y_c) - S(y_r) (harmless; S > 0 is safe,
the cost is C = -S):

    beta(delta) = beta_0 (1 + w (1 - exp(-k |delta|)))          in [beta_0, (1 + w) beta_0]  (mm_dpo_beta)
    L_H = mean -log sigma(beta(delta_H) d),   L_S = mean -log sigma(beta(delta_S) d)
    L   = (L_H + lambda L_S) / (1 + lambda)                                            (safe_mm_dpo_loss)

lambda is a constant inside a step. After each optimizer step (the trainer):
    J_C = EMA_0.95 of [ mean over pairs of (p_c C(y_c) + p_r C(y_r)) + threshold ]
where (p_c, p_r) = softmax of the policy's length-normalised log-probs of the two answers (its
preference between them), and
    ln lambda <- ln lambda + lr * lambda * J_C,  lambda clamped to [lambda_min, lambda_max]  (lagrange_update)
so lambda grows while the policy prefers costly answers (J_C > 0) and shrinks once it is below the
threshold. A pair the reward model is sure about (large |delta|) gets a larger beta: a sharper loss.

Safe-MM-DPO, variant `margin` (the margin built by `safe_mm_margin`, passed to `dpo_loss(margin=...)`):

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
  - "MM-RLHF: The Next Step Forward in Multimodal LLM Alignment" (Zhang et al., 2025): MM-DPO.
  - "Safe RLHF: Safe Reinforcement Learning from Human Feedback" (Dai et al., 2023).
  - "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
    (Rafailov et al., 2023); IPO: "A General Theoretical Paradigm to Understand Learning from
    Human Preferences" (Azar et al., 2023).
"""

from __future__ import annotations

import math

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


def mm_dpo_beta(reward_margin: torch.Tensor, *, beta: float, w: float, k: float) -> torch.Tensor:
    """MM-DPO's per-pair beta [B] from a reward model's margin [B] (score of chosen minus rejected):

      beta_i = beta (1 + w (1 - exp(-k |margin_i|)))

    beta at a zero margin, rising towards (1 + w) beta as the reward model grows sure of the pair
    (either way: a pair the model ranks the other way round is as sure). At least fp32.
    """
    if reward_margin.ndim != 1:
        raise ValueError(f"reward_margin must be [B], got shape {tuple(reward_margin.shape)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if w < 0 or k < 0:
        raise ValueError(f"w and k must be >= 0, got w={w}, k={k}")
    margin = reward_margin.to(torch.promote_types(reward_margin.dtype, torch.float32))
    return beta * (1.0 + w * (1.0 - torch.exp(-k * margin.abs())))


def safe_mm_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    helpful_margin: torch.Tensor,
    harmless_margin: torch.Tensor,
    *,
    lam: float,
    beta: float,
    w: float,
    k: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Safe-MM-DPO's loss (module docstring): (L_H + lam L_S) / (1 + lam), every input [B].

    The four log-probs are sequence log-probs (as dpo_loss); helpful_margin and harmless_margin are
    the helpful and harmless reward models' score gaps (chosen minus rejected), detached. lam >= 0 is
    the Lagrange multiplier, a constant here. Stats: loss_helpful (L_H), loss_harmless (L_S),
    beta_helpful_mean, beta_harmless_mean, and dpo_loss's reward_chosen, reward_rejected,
    reward_margin, reward_accuracy (implicit rewards at the base beta) and num_pairs.
    """
    _check_pairs(
        {
            "policy_chosen_logps": policy_chosen_logps,
            "policy_rejected_logps": policy_rejected_logps,
            "ref_chosen_logps": ref_chosen_logps,
            "ref_rejected_logps": ref_rejected_logps,
            "helpful_margin": helpful_margin,
            "harmless_margin": harmless_margin,
        }
    )
    if not (lam >= 0 and math.isfinite(lam)):
        raise ValueError(f"lam must be a finite number >= 0, got {lam}")
    dtype = torch.promote_types(policy_chosen_logps.dtype, torch.float32)
    logit_diff = (policy_chosen_logps.to(dtype) - ref_chosen_logps.to(dtype)) - (
        policy_rejected_logps.to(dtype) - ref_rejected_logps.to(dtype)
    )  # [B]
    beta_helpful = mm_dpo_beta(helpful_margin.detach(), beta=beta, w=w, k=k).to(dtype)
    beta_harmless = mm_dpo_beta(harmless_margin.detach(), beta=beta, w=w, k=k).to(dtype)
    loss_helpful = -F.logsigmoid(beta_helpful * logit_diff).mean()
    loss_harmless = -F.logsigmoid(beta_harmless * logit_diff).mean()
    loss = (loss_helpful + lam * loss_harmless) / (1.0 + lam)
    with torch.no_grad():
        reward_chosen = beta * (policy_chosen_logps.to(dtype) - ref_chosen_logps.to(dtype))
        reward_rejected = beta * (policy_rejected_logps.to(dtype) - ref_rejected_logps.to(dtype))
        stats = {
            "loss_helpful": float(loss_helpful),
            "loss_harmless": float(loss_harmless),
            "beta_helpful_mean": float(beta_helpful.mean()),
            "beta_harmless_mean": float(beta_harmless.mean()),
            "reward_chosen": float(reward_chosen.mean()),
            "reward_rejected": float(reward_rejected.mean()),
            "reward_margin": float((reward_chosen - reward_rejected).mean()),
            "reward_accuracy": float((reward_chosen > reward_rejected).to(dtype).mean()),
            "num_pairs": float(logit_diff.numel()),
        }
    return loss, stats


def preferred_cost(
    chosen_logps_mean: torch.Tensor,
    rejected_logps_mean: torch.Tensor,
    chosen_cost: torch.Tensor,
    rejected_cost: torch.Tensor,
) -> torch.Tensor:
    """The cost of each pair [B] under the policy's preference between its two answers:
    p_c C_c + p_r C_r with (p_c, p_r) = softmax(chosen_logps_mean, rejected_logps_mean), the
    length-normalised sequence log-probs. Its mean over a batch, plus the threshold, is the batch's
    J_C (Safe-MM-DPO's cost estimate; the trainer smooths it before lagrange_update)."""
    _check_pairs(
        {
            "chosen_logps_mean": chosen_logps_mean,
            "rejected_logps_mean": rejected_logps_mean,
            "chosen_cost": chosen_cost,
            "rejected_cost": rejected_cost,
        }
    )
    dtype = torch.promote_types(chosen_logps_mean.dtype, torch.float32)
    prefs = torch.softmax(torch.stack([chosen_logps_mean, rejected_logps_mean], dim=-1).to(dtype), dim=-1)
    return prefs[:, 0] * chosen_cost.to(dtype) + prefs[:, 1] * rejected_cost.to(dtype)


def lagrange_update(
    lam: float, cost: float, *, lr: float, lambda_min: float = 1e-6, lambda_max: float = 10.0
) -> float:
    """Safe RLHF's multiplier step in log space: ln lam' = ln lam + lr * lam * cost, then lam' is
    clamped to [lambda_min, lambda_max]. `cost` is the smoothed J_C (expected cost plus threshold):
    lam grows while it is positive and shrinks while it is negative; it never reaches 0."""
    if not 0 < lambda_min <= lambda_max:
        raise ValueError(f"need 0 < lambda_min <= lambda_max, got {lambda_min} and {lambda_max}")
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"lam must be a finite number > 0, got {lam}")
    if not math.isfinite(cost):
        raise ValueError(f"cost must be finite, got {cost}")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    step = lr * lam * cost
    # exp of a large step overflows; anything past ln(lambda_max) ends at lambda_max anyway
    log_lam = min(math.log(lam) + step, math.log(lambda_max) + 1.0)
    return min(max(math.exp(log_lam), lambda_min), lambda_max)


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
