"""Bradley-Terry reward-model loss: hand-computed values, the margin sign, stability, accuracy; the cost
model's classification term: hand-computed values, a re-implementation from the formula, its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.reward_model import cost_classification_loss, pairwise_accuracy, pairwise_loss


def test_pairwise_loss_by_hand():
    # gaps [2 - 1, 0 - 1] = [1, -1]: -log sigma(1) = log(1 + e^-1) = 0.313262,
    # -log sigma(-1) = log(1 + e) = 1.313262 -> mean 0.813262
    loss = pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2)
    assert loss.item() == pytest.approx(0.813262, abs=1e-6)
    # equal scores: log 2
    assert pairwise_loss(torch.zeros(3), torch.zeros(3)).item() == pytest.approx(math.log(2))


def test_margin_by_hand_and_sign():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # margin [1, -1]: gaps [1 - 1, -1 + 1] = [0, 0] -> log 2
    loss = pairwise_loss(chosen, rejected, margin=torch.tensor([1.0, -1.0]))
    assert loss.item() == pytest.approx(math.log(2))
    # subtracted inside: the loss grows with the margin, strictly
    losses = [pairwise_loss(chosen, rejected, margin=torch.full((2,), m)).item() for m in (-2, 0, 0.5, 3)]
    assert losses == sorted(losses) and len(set(losses)) == 4


def test_gradient_separates_chosen_from_rejected():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0], requires_grad=True)
    pairwise_loss(chosen, rejected).backward()
    # dL/dc_i = -(1 - sigma(gap_i)) / B = -sigma(-gap_i) / 2: [-0.134471, -0.365529]
    expected = -torch.sigmoid(-torch.tensor([1.0, -1.0])) / 2
    torch.testing.assert_close(chosen.grad, expected)
    torch.testing.assert_close(rejected.grad, -expected)


def test_stable_at_large_scores():
    chosen = torch.tensor([1000.0, -1000.0], requires_grad=True)
    rejected = torch.tensor([-1000.0, 1000.0])
    loss = pairwise_loss(chosen, rejected)
    loss.backward()
    # gaps [2000, -2000]: log(1 + e^-2000) = 0, log(1 + e^2000) = 2000 -> mean 1000
    # (the naive log(sigmoid(-2000)) would be log 0 = -inf)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(1000.0)
    # gradient -sigma(-gap) / 2 = [0, -0.5]
    torch.testing.assert_close(chosen.grad, torch.tensor([0.0, -0.5]))
    # low precision scores are promoted before the log-sigmoid
    half = pairwise_loss(chosen.detach().half(), rejected.half())
    assert half.dtype == torch.float32 and half.item() == pytest.approx(1000.0)


def test_matches_naive_reimplementation():
    g = torch.Generator().manual_seed(0)
    chosen, rejected, margin = (torch.randn(11, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    expected = sum(
        math.log1p(math.exp(-(c - r - m)))
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist())
    )
    assert pairwise_loss(chosen, rejected, margin=margin).item() == pytest.approx(expected / 11, rel=1e-12)


def test_pairwise_accuracy():
    # 2 > 1 yes, 0 > 1 no, 1 > 1 no (a tie is a miss) -> 1/3
    assert pairwise_accuracy(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])) == pytest.approx(
        1 / 3
    )
    assert pairwise_accuracy(torch.tensor([5.0]), torch.tensor([-5.0])) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="rejected_scores"):
        pairwise_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="chosen_scores"):
        pairwise_loss(torch.zeros(3, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="margin"):
        pairwise_loss(torch.zeros(3), torch.zeros(3), margin=torch.zeros(2))
    with pytest.raises(ValueError, match="rejected_scores"):
        pairwise_accuracy(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="at least one pair"):
        pairwise_accuracy(torch.zeros(0), torch.zeros(0))


def test_cost_classification_loss_by_hand():
    # safe answers want S > 0: -log sigma(2) = log(1 + e^-2) = 0.126928, -log sigma(-1) = log(1 + e) = 1.313262;
    # the unsafe one wants S < 0: -log sigma(-(-3)) = log(1 + e^-3) = 0.048587 -> mean 1.488777 / 3 = 0.496259
    scores, is_safe = torch.tensor([2.0, -1.0, -3.0]), torch.tensor([True, True, False])
    loss = cost_classification_loss(scores, is_safe)
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.e) + math.log1p(math.exp(-3))) / 3
    assert loss.item() == pytest.approx(expected) and loss.item() == pytest.approx(0.496259, abs=1e-6)
    # a score of 0 says nothing either way: log 2 whatever the label
    for label in (True, False):
        assert cost_classification_loss(torch.zeros(1), torch.tensor([label])).item() == pytest.approx(
            math.log(2)
        )
    # flipping every label and every score sign leaves the loss unchanged
    torch.testing.assert_close(cost_classification_loss(-scores, ~is_safe), loss)


def test_cost_classification_loss_matches_the_formula():
    """Safe-RLHF's form with the sign label s = +1 unsafe, -1 safe on the cost C = -S: -log sigma(s * C)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(13, generator=g, dtype=torch.float64) * 4
    is_safe = torch.rand(13, generator=g) < 0.5
    signs = [-1.0 if safe else 1.0 for safe in is_safe.tolist()]
    expected = sum(math.log1p(math.exp(-s * -score)) for s, score in zip(signs, scores.tolist())) / 13
    assert cost_classification_loss(scores, is_safe).item() == pytest.approx(expected, rel=1e-12)


def test_cost_classification_gradient_pushes_scores_towards_their_label():
    scores = torch.tensor([1.0, 1.0], requires_grad=True)
    cost_classification_loss(scores, torch.tensor([True, False])).backward()
    # d/dS of -log sigma(S) / N = -sigma(-S) / 2; of -log sigma(-S) / N = sigma(S) / 2
    expected = (
        torch.tensor([-torch.sigmoid(torch.tensor(-1.0)).item(), torch.sigmoid(torch.tensor(1.0)).item()]) / 2
    )
    torch.testing.assert_close(scores.grad, expected)


def test_cost_classification_loss_is_stable_and_promotes_low_precision():
    scores = torch.tensor([-1000.0, 1000.0], requires_grad=True)
    loss = cost_classification_loss(scores, torch.tensor([True, False]))  # both wrong by 1000
    loss.backward()
    assert loss.item() == pytest.approx(1000.0)  # (1000 + 1000) / 2; the naive log(sigmoid) is -inf
    torch.testing.assert_close(scores.grad, torch.tensor([-0.5, 0.5]))
    half = cost_classification_loss(
        torch.tensor([2.0, -3.0], dtype=torch.bfloat16), torch.tensor([True, False])
    )
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx((math.log1p(math.exp(-2)) + math.log1p(math.exp(-3))) / 2, rel=1e-6)


@pytest.mark.parametrize(
    ("scores", "is_safe", "message"),
    [
        (torch.zeros(3), torch.ones(2, dtype=torch.bool), "must both be"),
        (torch.zeros(3, 1), torch.ones(3, 1, dtype=torch.bool), "must both be"),
        (torch.zeros(2), torch.tensor([1.0, 0.0]), "bool"),
        (torch.zeros(0), torch.zeros(0, dtype=torch.bool), "at least one labelled answer"),
    ],
)
def test_cost_classification_loss_bad_arguments(scores, is_safe, message):
    with pytest.raises(ValueError, match=message):
        cost_classification_loss(scores, is_safe)
