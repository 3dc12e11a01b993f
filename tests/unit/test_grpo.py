"""GRPO advantages and loss: hand-computed values, a naive re-implementation, normaliser invariance,
and the truncated importance weight (Yao et al. 2025)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.grpo import (
    LOSS_AGGREGATIONS,
    group_advantages,
    grpo_loss,
    truncated_importance_weights,
)


def test_group_advantages_by_hand():
    # group 1: rewards [2.25, -2]: mean 0.125, unbiased std = |2.25 - -2| / sqrt(2) = 3.0052
    #   A = +-2.125 / 3.0052 = +-0.70711 (every 2-member group gives +-1/sqrt(2) before eps)
    # group 2: [0, 0]: no variance -> 0 whatever the scaling
    rewards = torch.tensor([2.25, -2.0, 0.0, 0.0])
    adv = group_advantages(rewards, 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]))
    # none (Dr. GRPO): only centred
    torch.testing.assert_close(
        group_advantages(rewards, 2, scale="none"), torch.tensor([2.125, -2.125, 0.0, 0.0])
    )
    # batch: centred by the group, scaled by the std of all four rewards (unbiased: 1.7545)
    batch_std = torch.tensor([2.25, -2.0, 0.0, 0.0]).std()
    torch.testing.assert_close(
        group_advantages(rewards, 2, scale="batch", eps=0.0), torch.tensor([2.125, -2.125, 0, 0]) / batch_std
    )


def test_group_advantages_eps_and_errors():
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2, eps=1e-4)
    assert adv[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4))
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.tensor([1.0, 2.0]), 2, scale="rank")


def test_grpo_loss_by_hand():
    # one sequence of two tokens, A = 1, eps 0.2, kl_coef 0.1
    # token 1: logp_new = log 1.5, logp_old = 0 -> ratio 1.5, clipped to 1.2: min(1.5, 1.2) = 1.2
    #          ref = logp_new: KL = e^0 - 0 - 1 = 0            -> obj = 1.2
    # token 2: ratio = 1 -> obj 1.0 ; ref - new = -1: KL = e^-1 + 1 - 1 = 0.36788 -> obj = 1 - 0.036788
    # seq-mean-token-mean: loss = -(1.2 + 0.963212) / 2 = -1.081606
    new = torch.tensor([[math.log(1.5), 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[math.log(1.5), -1.0]])
    mask = torch.tensor([[True, True]])
    loss, stats = grpo_loss(new, old, ref, torch.tensor([1.0]), mask, kl_coef=0.1)
    assert loss.item() == pytest.approx(-(1.2 + 1 - 0.1 * math.exp(-1)) / 2, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["kl"] == pytest.approx(math.exp(-1) / 2, abs=1e-6)
    # negative advantage: min(1.5 * -1, 1.2 * -1) = -1.5, not clipped (pessimistic bound)
    loss, stats = grpo_loss(new, old, ref, torch.tensor([-1.0]), mask, kl_coef=0.0)
    assert loss.item() == pytest.approx(-(-1.5 - 1.0) / 2, abs=1e-6)
    assert stats["clip_fraction"] == 0.0


def test_separate_low_and_high_clip():
    # ratio 0.7 with A = -1: the low clip 1 - 0.2 = 0.8 binds: min(-0.7, -0.8) = -0.8
    # ratio 1.25 with A = +1: the high clip 1 + 0.28 = 1.28 does not bind: 1.25
    new = torch.log(torch.tensor([[0.7], [1.25]]))
    old = torch.zeros(2, 1)
    loss, _ = grpo_loss(
        new,
        old,
        None,
        torch.tensor([-1.0, 1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.0,
    )
    assert loss.item() == pytest.approx(-(-0.8 + 1.25) / 2, abs=1e-6)


def _naive_grpo_loss(new, old, ref, adv, mask, eps_low, eps_high, kl_coef, agg, max_len, weights=None):
    """Loop-by-loop re-implementation from the formula in DESIGN.md section 6 (`weights`: each token's
    importance weight on its surrogate, not on its KL term)."""
    per_seq, total, count = [], 0.0, 0
    for i in range(len(new)):
        terms = []
        for t in range(len(new[i])):
            if not mask[i][t]:
                continue
            r = math.exp(new[i][t] - old[i][t])
            obj = min(r * adv[i], min(max(r, 1 - eps_low), 1 + eps_high) * adv[i])
            if weights is not None:
                obj *= weights[i][t]
            d = ref[i][t] - new[i][t]
            obj -= kl_coef * (math.exp(d) - d - 1)
            terms.append(-obj)
        per_seq.append(sum(terms) / max(len(terms), 1))
        total += sum(terms)
        count += len(terms)
    if agg == "seq-mean-token-mean":
        return sum(per_seq) / len(per_seq)
    if agg == "token-mean":
        return total / count
    return total / (len(per_seq) * max_len)


def _random_batch(seed, batch=6, width=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(batch, width, generator=g, dtype=torch.float64) * 0.3
    ref = old + torch.randn(batch, width, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return new, old, ref, adv, mask


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_matches_naive_reimplementation(agg):
    new, old, ref, adv, mask = _random_batch(0)
    loss, _ = grpo_loss(
        new,
        old,
        ref,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.04,
        loss_agg=agg,
        max_completion_length=10,
    )
    expected = _naive_grpo_loss(
        new.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 0.04, agg, 10
    )
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_micro_batches_with_global_normaliser_sum_to_the_full_batch(agg):
    new, old, ref, adv, mask = _random_batch(1)
    new.requires_grad_(True)
    full, _ = grpo_loss(new, old, ref, adv, mask, loss_agg=agg, max_completion_length=7)
    full.backward()
    full_grad = new.grad.clone()
    new.grad = None
    normalizer = float(mask.sum()) if agg == "token-mean" else float(mask.shape[0])
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        # micro-batches are padded to their own width: the aggregation must not depend on it
        width = int(mask[rows].sum(1).max())
        part, _ = grpo_loss(
            new[rows, :width],
            old[rows, :width],
            ref[rows, :width],
            adv[rows],
            mask[rows, :width],
            loss_agg=agg,
            normalizer=normalizer,
            max_completion_length=7,
        )
        part.backward()
        parts += part.item()
    assert parts == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(new.grad, full_grad)


def test_importance_weighted_loss_by_hand():
    # the by-hand batch above (A = 1, eps 0.2, kl_coef 0.1), now with the sampler's log-probs off
    # pi_old's: logp_old - logp_sampler = log 3 and log 0.5 -> w = min(3, cap 2) = 2 and 0.5
    # token 1: obj = 2 * 1.2 - 0.1 * 0                 = 2.4
    # token 2: obj = 0.5 * 1.0 - 0.1 * e^-1 (KL unweighted) = 0.5 - 0.036788 = 0.463212
    # seq-mean-token-mean: loss = -(2.4 + 0.463212) / 2 = -1.431606
    new = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    sampler = torch.tensor([[-math.log(3.0), math.log(2.0)]])
    ref = torch.tensor([[math.log(1.5), -1.0]])
    weights = truncated_importance_weights(old, sampler, 2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5]]))
    loss, stats = grpo_loss(
        new,
        old,
        ref,
        torch.tensor([1.0]),
        torch.tensor([[True, True]]),
        kl_coef=0.1,
        importance_weights=weights,
    )
    assert loss.item() == pytest.approx(-(2.4 + 0.5 - 0.1 * math.exp(-1)) / 2, abs=1e-6)
    assert stats["kl"] == pytest.approx(math.exp(-1) / 2, abs=1e-6)  # the statistics are unweighted
    # the weight is held constant: token 1 is clipped (no gradient), token 2's surrogate gradient
    # is scaled by w: d/dnew [-(0.5 * ratio - 0.1 * KL)] / 2 at ratio 1, d KL/dnew = 1 - e^-1
    loss.backward()
    expected = -(0.5 * 1.0 - 0.1 * (1 - math.exp(-1))) / 2
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, expected]]))
    # weights of 1 change nothing, bit for bit
    plain, _ = grpo_loss(new, old, ref, torch.tensor([1.0]), torch.tensor([[True, True]]), kl_coef=0.1)
    ones, _ = grpo_loss(
        new,
        old,
        ref,
        torch.tensor([1.0]),
        torch.tensor([[True, True]]),
        kl_coef=0.1,
        importance_weights=torch.ones(1, 2),
    )
    assert plain.item() == ones.item()


def _naive_truncated_weights(old, sampler, cap):
    return [[min(math.exp(o - s), cap) for o, s in zip(orow, srow)] for orow, srow in zip(old, sampler)]


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_importance_weighted_loss_matches_naive_reimplementation(agg):
    new, old, ref, adv, mask = _random_batch(3)
    g = torch.Generator().manual_seed(4)
    sampler = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.5  # some above the cap
    weights = truncated_importance_weights(old, sampler, 1.5)
    assert (weights == 1.5).any() and (weights < 1).any()
    loss, _ = grpo_loss(
        new,
        old,
        ref,
        adv,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.04,
        loss_agg=agg,
        max_completion_length=10,
        importance_weights=weights,
    )
    expected = _naive_grpo_loss(
        new.tolist(),
        old.tolist(),
        ref.tolist(),
        adv.tolist(),
        mask.tolist(),
        0.2,
        0.28,
        0.04,
        agg,
        10,
        weights=_naive_truncated_weights(old.tolist(), sampler.tolist(), 1.5),
    )
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_on_policy_first_step_gradient_is_the_policy_gradient():
    # ratio 1 everywhere, no KL: d loss / d logp_new = -A / len for seq-mean-token-mean
    new = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    loss, stats = grpo_loss(new, new.detach(), None, torch.tensor([2.0, -1.0]), mask, kl_coef=0.0)
    loss.backward()
    expected = torch.tensor([[-2 / 2 / 2, -2 / 2 / 2, 0], [1 / 3 / 2, 1 / 3 / 2, 1 / 3 / 2]])
    torch.testing.assert_close(new.grad, expected)
    assert stats["ratio_abs_dev"] == 0.0 and stats["clip_fraction"] == 0.0


def test_bad_arguments():
    new, old, ref, adv, mask = _random_batch(2)
    with pytest.raises(ValueError, match="loss_agg"):
        grpo_loss(new, old, ref, adv, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(new, old, None, adv, mask, kl_coef=0.1)
