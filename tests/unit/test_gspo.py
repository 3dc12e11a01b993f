"""GSPO (Zheng et al. 2025): the sequence-level importance ratio by hand, against a per-sequence
re-implementation (values and gradients), and the clip fractions it reports per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.grpo import LOSS_AGGREGATIONS, grpo_loss, gspo_loss, sequence_importance_ratio


def _hand_batch():
    # sequence 0: log-ratios [ln 2, 0] -> s_0 = exp(ln 2 / 2) = sqrt 2 = 1.41421, A = +1: above
    #             1 + 0.2, clipped: obj = 1.2 on both tokens, no gradient
    # sequence 1: log-ratios [ln 0.9, ln 0.9, pad] -> s_1 = 0.9, A = -1: inside [0.8, 1.2]: obj = -0.9
    # the padded token (log-ratio ln 5) must not count
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]])
    new = old + torch.tensor([[math.log(2.0), 0.0, 0.0], [math.log(0.9), math.log(0.9), math.log(5.0)]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    return new.requires_grad_(), old, torch.tensor([1.0, -1.0]), mask


def test_sequence_ratio_by_hand():
    new, old, _, mask = _hand_batch()
    ratio = sequence_importance_ratio(new, old, mask)
    torch.testing.assert_close(ratio[:, :2], torch.tensor([[2**0.5, 2**0.5], [0.9, 0.9]]))
    # each token's gradient is s_i (the token form of GSPO): d sum(ratio) / d logp_new_it = s_i
    (grad,) = torch.autograd.grad(ratio.sum(), new)
    torch.testing.assert_close(grad, torch.tensor([[2**0.5, 2**0.5, 2**0.5], [0.9, 0.9, 0.9]]))


def test_gspo_loss_by_hand():
    new, old, adv, mask = _hand_batch()
    loss, stats = gspo_loss(new, old, None, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0)
    # seq-mean-token-mean: -(1.2 + -0.9) / 2 = -0.15
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    # gradient: sequence 0 is clipped (0); sequence 1: d/dlogp_1t of -(1/2)(1/2)(s_1,t * -1) = +0.9/4
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [0.225, 0.225, 0.0]]))
    # one sequence of two clipped, at the top of the range
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert (stats["clip_ratio_low"], stats["clip_ratio_high"]) == (0.0, pytest.approx(0.5))
    assert stats["num_sequences"] == 2 and stats["num_tokens"] == 4
    # token-mean over the 4 tokens: -(1.2 * 2 + -0.9 * 2) / 4 = -0.15
    loss, _ = gspo_loss(new, old, None, adv, mask, kl_coef=0.0, loss_agg="token-mean")
    assert loss.item() == pytest.approx(-0.15, abs=1e-6)
    # the token-level GRPO ratio of sequence 0 differs: token 0 is 2 (clipped), token 1 is 1
    token_loss, _ = grpo_loss(new, old, None, adv, mask, kl_coef=0.0)
    assert token_loss.item() == pytest.approx(-((1.2 + 1.0) / 2 - 0.9) / 2, abs=1e-6)


def _naive_gspo(new, old, ref, adv, mask, eps_low, eps_high, kl_coef, agg, max_len):
    """Sequence by sequence, as the paper writes it: s_i = exp(mean_t log-ratio) with the gradient
    through the mean, J_i = min(s_i A_i, clip(s_i) A_i), then each token's KL term; a sequence's
    surrogate counts once per token under the token sums."""
    per_seq, total, count = [], 0, 0
    for i in range(new.shape[0]):
        keep = mask[i]
        n = int(keep.sum())
        s = torch.exp((new[i][keep] - old[i][keep]).mean())
        surrogate = torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i])
        d = ref[i][keep] - new[i][keep]
        kl = torch.exp(d) - d - 1
        terms = -(surrogate - kl_coef * kl)  # [n]
        per_seq.append(terms.sum() / n)
        total = total + terms.sum()
        count += n
    if agg == "seq-mean-token-mean":
        return sum(per_seq) / len(per_seq)
    if agg == "token-mean":
        return total / count
    return total / (len(per_seq) * max_len)


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_gspo_matches_a_per_sequence_reimplementation_with_gradients(agg):
    g = torch.Generator().manual_seed(7)
    batch, width = 6, 5
    old = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3
    new = (old + torch.randn(batch, width, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    ref = old + torch.randn(batch, width, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.tensor([1, 5, 3, 2, 5, 4])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    # a clip range that some sequences leave and some do not
    options = dict(clip_eps_low=0.05, clip_eps_high=0.08, kl_coef=0.04, loss_agg=agg)
    loss, stats = gspo_loss(new, old, ref, adv, mask, max_completion_length=9, **options)
    expected = _naive_gspo(new, old, ref, adv, mask, 0.05, 0.08, 0.04, agg, 9)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, new)
    (expected_grad,) = torch.autograd.grad(expected, new)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert bool((grad[~mask] == 0).all()), "padded tokens take no gradient"
    # the clip fractions count sequences
    s = torch.stack([torch.exp((new[i][mask[i]] - old[i][mask[i]]).mean()) for i in range(batch)])
    low = ((s < 0.95) & (adv < 0)).double().mean().item()
    high = ((s > 1.08) & (adv > 0)).double().mean().item()
    assert 0 < low + high < 1, "the test's clip range should clip some sequences and not others"
    assert stats["clip_ratio_low"] == pytest.approx(low) and stats["clip_ratio_high"] == pytest.approx(high)
    assert stats["clip_fraction"] == pytest.approx(low + high)


def test_a_sequence_outside_the_mask_counts_nowhere():
    # sequence 1 has no token in the mask (a masked truncated completion): ratio 1, no clip, no count
    new = torch.log(torch.tensor([[2.0, 2.0], [3.0, 3.0]]))
    mask = torch.tensor([[True, True], [False, False]])
    loss, stats = gspo_loss(new, torch.zeros(2, 2), None, torch.tensor([1.0, 1.0]), mask, kl_coef=0.0)
    assert stats["num_sequences"] == 1 and stats["clip_fraction"] == 1.0
    assert loss.item() == pytest.approx(-1.2 / 2)  # seq-mean over both rows: the empty one adds 0


def test_token_level_clip_split():
    # ratios 0.7 (A < 0: low), 1.5 (A > 0: high), 1.5 with A < 0 (not clipped), 1.0
    new = torch.log(torch.tensor([[0.7, 1.5], [1.5, 1.0]]))
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, stats = grpo_loss(new, torch.zeros(2, 2), None, adv, mask, kl_coef=0.0)
    # row 0 (A = -1): 0.7 low-clipped, 1.5 not; row 1 (A = +1): 1.5 high-clipped, 1.0 not
    assert (stats["clip_ratio_low"], stats["clip_ratio_high"]) == (0.25, 0.25)
    assert stats["clip_fraction"] == 0.5


def test_unknown_level_is_refused():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(x, x, None, torch.zeros(1), x.bool(), kl_coef=0.0, importance_sampling_level="group")
