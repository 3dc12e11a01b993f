"""DPO/IPO loss and Safe-MM-DPO (the margin; the lagrangian's beta, loss, cost and multiplier update):
hand-computed values, naive re-implementations from the formulas, signs."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.dpo import (
    dpo_loss,
    lagrange_update,
    mm_dpo_beta,
    preferred_cost,
    safe_mm_dpo_loss,
    safe_mm_margin,
    sequence_logps,
)


def _softplus(x: float) -> float:
    # -log sigma(-x) = log(1 + e^x), written the overflow-safe way
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# two pairs used by several tests (beta = 0.5):
#   pair 1: pc=-1, rc=-2, pr=-3, rr=-2 -> chosen logratio +1, rejected -1, logit_diff 2,  h = 1
#   pair 2: pc=-2, rc=-1, pr=-2, rr=-2 -> chosen logratio -1, rejected  0, logit_diff -1, h = -0.5
PC = [-1.0, -2.0]
PR = [-3.0, -2.0]
RC = [-2.0, -1.0]
RR = [-2.0, -2.0]


def _pairs(requires_grad=False):
    pc = torch.tensor(PC, requires_grad=requires_grad)
    pr = torch.tensor(PR, requires_grad=requires_grad)
    return pc, pr, torch.tensor(RC), torch.tensor(RR)


def test_sequence_logps_by_hand():
    token_logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -7.0, -7.0], [-4.0, -4.0, -4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # sums: -1 - 2 = -3 ; -0.5 ; an empty row gives 0
    torch.testing.assert_close(sequence_logps(token_logprobs, mask), torch.tensor([-3.0, -0.5, 0.0]))
    # averages: -3 / 2 = -1.5 ; -0.5 / 1 ; 0
    torch.testing.assert_close(
        sequence_logps(token_logprobs, mask, average=True), torch.tensor([-1.5, -0.5, 0.0])
    )
    with pytest.raises(ValueError, match="mask"):
        sequence_logps(token_logprobs, mask[:, :2])


def test_dpo_sigmoid_by_hand():
    # losses: -log sigma(1) = log(1 + e^-1) = 0.313262 ; -log sigma(-0.5) = log(1 + e^0.5) = 0.974077
    loss, stats = dpo_loss(*_pairs(), beta=0.5)
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(0.5))) / 2)
    assert loss.item() == pytest.approx(0.643670, abs=1e-6)
    # rewards: chosen 0.5 * [1, -1] -> mean 0 ; rejected 0.5 * [-1, 0] -> mean -0.25
    # margins [1, -0.5] -> mean 0.25 ; accuracy: only pair 1 has chosen > rejected -> 0.5
    assert stats["reward_chosen"] == pytest.approx(0.0)
    assert stats["reward_rejected"] == pytest.approx(-0.25)
    assert stats["reward_margin"] == pytest.approx(0.25)
    assert stats["reward_accuracy"] == pytest.approx(0.5)
    assert stats["num_pairs"] == 2.0


def test_dpo_margin_by_hand_and_sign():
    # margin [0.5, -0.5]: z = h - m = [1 - 0.5, -0.5 + 0.5] = [0.5, 0]
    # losses: log(1 + e^-0.5) = 0.474077 ; log 2 = 0.693147 -> mean 0.583612
    loss, stats = dpo_loss(*_pairs(), beta=0.5, margin=torch.tensor([0.5, -0.5]))
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-0.5)) + math.log(2)) / 2)
    # the margin changes the loss, not the implicit rewards
    assert stats["reward_margin"] == pytest.approx(0.25)
    # a positive margin asks for a larger reward gap: the loss grows with it, strictly
    losses = [dpo_loss(*_pairs(), beta=0.5, margin=torch.full((2,), m))[0].item() for m in (-1, 0, 1, 2)]
    assert losses == sorted(losses) and len(set(losses)) == 4
    # and so does the push on the chosen answer
    grads = []
    for m in (0.0, 1.0):
        pc, pr, rc, rr = _pairs(requires_grad=True)
        dpo_loss(pc, pr, rc, rr, beta=0.5, margin=torch.full((2,), m))[0].backward()
        grads.append(pc.grad[0].item())
    # dL/dpc_1 = -beta (1 - sigma(h - m)) / B: m = 0 -> -0.25 * 0.268941 ; m = 1 -> -0.25 * 0.5
    assert grads == pytest.approx([-0.25 / (1 + math.e), -0.125])


def test_gradient_raises_chosen_and_lowers_rejected():
    pc, pr, rc, rr = _pairs(requires_grad=True)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5)
    loss.backward()
    # descent moves pc by -grad: chosen log-probs go up, rejected go down, for both pairs
    assert (pc.grad < 0).all() and (pr.grad > 0).all()
    # dL/dpc_i = -beta (1 - sigma(h_i)) / B = -0.25 (1 - sigma(h_i)); dL/dpr_i = -dL/dpc_i
    sig = torch.sigmoid(torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(pc.grad, -0.25 * (1 - sig))
    torch.testing.assert_close(pr.grad, 0.25 * (1 - sig))


def test_label_smoothing_by_hand_and_limits():
    pc, pr, rc, rr = (t[:1].double() for t in _pairs())  # pair 1 alone: z = 1
    # ls = 0.25: 0.75 log(1 + e^-1) + 0.25 log(1 + e) = 0.234947 + 0.328316 = 0.563262
    #   (log(1 + e) = log(1 + e^-1) + 1, so this is log(1 + e^-1) + 0.25)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.25)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)) + 0.25)
    # ls -> 0 is plain DPO
    plain, _ = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=1e-9)[0].item() == pytest.approx(plain.item())
    # ls -> 0.5: the loss becomes even in z: L(z) - L(-z) = -(1 - 2 ls) z -> 0
    ls = 0.5 - 1e-6
    forward, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=ls)
    swapped, _ = dpo_loss(pr, pc, rr, rc, beta=0.5, label_smoothing=ls)
    assert forward.item() - swapped.item() == pytest.approx(-(1 - 2 * ls) * 1.0, abs=1e-9)
    assert abs(forward.item() - swapped.item()) < 1e-5


def test_label_smoothing_stops_pushing_at_a_finite_gap():
    # dL/dz = sigma(z) - (1 - ls): zero at z* = log((1 - ls) / ls) = log 3 for ls = 0.25
    ls, beta = 0.25, 0.5
    for z, sign in ((math.log(3), 0), (math.log(3) - 1, -1), (math.log(3) + 1, 1)):
        pc = torch.tensor([z / beta], dtype=torch.float64, requires_grad=True)
        zero = torch.zeros(1, dtype=torch.float64)
        dpo_loss(pc, zero, zero, zero, beta=beta, label_smoothing=ls)[0].backward()
        expected = beta * (1 / (1 + math.exp(-z)) - (1 - ls))
        assert pc.grad.item() == pytest.approx(expected, abs=1e-12)
        assert (pc.grad.item() > 1e-12) - (pc.grad.item() < -1e-12) == sign


def test_ipo_by_hand():
    # (logit_diff - 1 / (2 beta))^2 with 1 / (2 * 0.5) = 1: (2 - 1)^2 = 1 ; (-1 - 1)^2 = 4 -> mean 2.5
    loss, _ = dpo_loss(*_pairs(), beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx(2.5)
    # margin [0.5, -0.5] -> margin / beta = [1, -1]: (2 - 1 - 1)^2 = 0 ; (-1 + 1 - 1)^2 = 1 -> mean 0.5
    loss, _ = dpo_loss(*_pairs(), beta=0.5, margin=torch.tensor([0.5, -0.5]), loss_type="ipo")
    assert loss.item() == pytest.approx(0.5)


def _naive_dpo(pc, pr, rc, rr, beta, margin, ls, loss_type):
    """Pair-by-pair re-implementation of the formulas in dpo_loss's docstring."""
    losses = []
    for i in range(len(pc)):
        logit_diff = (pc[i] - rc[i]) - (pr[i] - rr[i])
        z = beta * logit_diff - (margin[i] if margin is not None else 0.0)
        if loss_type == "sigmoid":
            losses.append((1 - ls) * _softplus(-z) + ls * _softplus(z))
        else:
            losses.append((z / beta - 1 / (2 * beta)) ** 2)
    return sum(losses) / len(losses)


@pytest.mark.parametrize(
    ("loss_type", "ls", "with_margin"),
    [("sigmoid", 0.0, False), ("sigmoid", 0.1, True), ("sigmoid", 0.3, False), ("ipo", 0.0, True)],
)
def test_matches_naive_reimplementation(loss_type, ls, with_margin):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(9, generator=g, dtype=torch.float64) * 50 for _ in range(4))
    margin = torch.randn(9, generator=g, dtype=torch.float64) if with_margin else None
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.2, margin=margin, label_smoothing=ls, loss_type=loss_type)
    expected = _naive_dpo(
        pc.tolist(),
        pr.tolist(),
        rc.tolist(),
        rr.tolist(),
        0.2,
        margin.tolist() if margin is not None else None,
        ls,
        loss_type,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    chosen = [0.2 * (a - b) for a, b in zip(pc.tolist(), rc.tolist())]
    rejected = [0.2 * (a - b) for a, b in zip(pr.tolist(), rr.tolist())]
    assert stats["reward_accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / 9)


def test_large_reward_gaps_stay_finite():
    # beta 1, pc = [2000, -2000], pr = -pc, refs 0: z = pc - pr = [4000, -4000]; log sigma(-4000)
    # must not underflow to -inf
    big = torch.tensor([2000.0, -2000.0], requires_grad=True)
    zero = torch.zeros(2)
    loss, _ = dpo_loss(big, -big, zero, zero, beta=1.0)
    loss.backward()
    # pair 1: log(1 + e^-4000) = 0 ; pair 2: log(1 + e^4000) = 4000 -> mean 2000
    assert loss.item() == pytest.approx(2000.0)
    assert torch.isfinite(big.grad).all()


def test_bf16_inputs_are_computed_in_fp32():
    pc, pr, rc, rr = (t.to(torch.bfloat16) for t in _pairs())
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.643670, abs=1e-6)


def test_safe_mm_margin_by_hand():
    helpful_chosen, helpful_rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    harmless_chosen, harmless_rejected = torch.tensor([0.5, -1.0]), torch.tensor([-0.5, 1.0])
    # helpful gaps [1, -1], harmless gaps [1, -2], chosen safer (derived) [True, False]
    # m = 1 * [1, -1] + 2 * [1, -2] + 0.3 * [1, 0] = [3.3, -5]
    margin = safe_mm_margin(
        helpful_chosen,
        helpful_rejected,
        harmless_chosen,
        harmless_rejected,
        helpful_weight=1.0,
        harmless_weight=2.0,
        safety_margin=0.3,
    )
    torch.testing.assert_close(margin, torch.tensor([3.3, -5.0]))
    # an explicit label overrides the derived one: [False, True] -> [3.0, -4.7]
    margin = safe_mm_margin(
        helpful_chosen,
        helpful_rejected,
        harmless_chosen,
        harmless_rejected,
        harmless_weight=2.0,
        safety_margin=0.3,
        chosen_is_safer=torch.tensor([False, True]),
    )
    torch.testing.assert_close(margin, torch.tensor([3.0, -4.7]))
    # defaults: weights 1, no safety offset -> [1 + 1, -1 - 2] = [2, -3]
    torch.testing.assert_close(
        safe_mm_margin(helpful_chosen, helpful_rejected, harmless_chosen, harmless_rejected),
        torch.tensor([2.0, -3.0]),
    )


def test_safety_offset_raises_the_loss_of_safer_chosen_pairs_only():
    # two identical DPO pairs, the first with a safer chosen answer: only its loss goes up with delta
    harmless_chosen, harmless_rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    zero = torch.zeros(2)
    per_pair = []
    for delta in (0.0, 1.0):
        margin = safe_mm_margin(zero, zero, harmless_chosen, harmless_rejected, safety_margin=delta)
        per_pair.append(
            [
                dpo_loss(*(t[i : i + 1] for t in _pairs()), beta=0.5, margin=margin[i : i + 1])[0].item()
                for i in (0, 1)
            ]
        )
    assert per_pair[1][0] > per_pair[0][0]
    assert per_pair[1][1] == pytest.approx(per_pair[0][1])
    # pair 1: z = 1 - (1 + 1) = -1 -> log(1 + e) = 1.313262
    assert per_pair[1][0] == pytest.approx(math.log(1 + math.e))


def test_bad_arguments():
    pc, pr, rc, rr = _pairs()
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(pc, pr, rc, rr[:1])
    with pytest.raises(ValueError, match="policy_chosen_logps"):
        dpo_loss(pc[:, None], pr, rc, rr)
    with pytest.raises(ValueError, match="margin"):
        dpo_loss(pc, pr, rc, rr, margin=torch.zeros(3))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(pc, pr, rc, rr, loss_type="hinge")
    with pytest.raises(ValueError, match="harmless_rejected"):
        safe_mm_margin(pc, pr, rc, rr[:1])
    with pytest.raises(ValueError, match="chosen_is_safer"):
        safe_mm_margin(pc, pr, rc, rr, chosen_is_safer=torch.tensor([True]))


# --------------------------------------------------------------------------- Safe-MM-DPO, lagrangian


def test_mm_dpo_beta_by_hand():
    # beta (1 + w (1 - exp(-k |m|))) with beta 0.1, w 0.5, k 0.5
    margins = torch.tensor([0.0, 2.0, -2.0, 1e4])
    got = mm_dpo_beta(margins, beta=0.1, w=0.5, k=0.5)
    by_hand = [0.1, 0.1 * (1 + 0.5 * (1 - math.exp(-1.0))), 0.1 * (1 + 0.5 * (1 - math.exp(-1.0))), 0.15]
    assert got.tolist() == pytest.approx(by_hand, rel=1e-6)
    assert got.dtype == torch.float32
    assert mm_dpo_beta(torch.tensor([3.0]), beta=0.2, w=0.0, k=5.0).item() == pytest.approx(0.2)  # w=0: DPO
    assert mm_dpo_beta(torch.tensor([3.0]), beta=0.2, w=1.0, k=0.0).item() == pytest.approx(0.2)  # k=0: DPO
    # inside [beta, (1 + w) beta] and rising with |m|
    many = mm_dpo_beta(torch.linspace(0, 20, 50), beta=0.1, w=0.5, k=0.5)
    assert (many >= 0.1 - 1e-9).all() and (many <= 0.15 + 1e-9).all() and (many.diff() >= 0).all()


def _naive_safe_mm(pc, pr, rc, rr, dh, ds, lam, beta, w, k):
    """The authors' loss written per pair in plain Python."""
    lh, ls = [], []
    for i in range(len(pc)):
        d = (pc[i] - rc[i]) - (pr[i] - rr[i])
        bh = beta * (1 + w * (1 - math.exp(-k * abs(dh[i]))))
        bs = beta * (1 + w * (1 - math.exp(-k * abs(ds[i]))))
        lh.append(_softplus(-bh * d))
        ls.append(_softplus(-bs * d))
    mh, ms = sum(lh) / len(lh), sum(ls) / len(ls)
    return (mh + lam * ms) / (1 + lam), mh, ms


def test_safe_mm_dpo_loss_by_hand():
    # pairs 1 and 2 (logit_diff 2 and -1), beta 0.5, w 1, k ln 2: |dh| = 1 -> beta 0.75; |ds| = 0 -> 0.5
    pc, pr, rc, rr = _pairs()
    dh, ds = torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.0])
    loss, stats = safe_mm_dpo_loss(pc, pr, rc, rr, dh, ds, lam=3.0, beta=0.5, w=1.0, k=math.log(2))
    lh = (_softplus(-1.5) + _softplus(0.75)) / 2  # beta_H 0.75 on both pairs
    ls = (_softplus(-1.0) + _softplus(0.5)) / 2  # beta_S 0.5 = beta
    assert stats["loss_helpful"] == pytest.approx(lh, rel=1e-6)
    assert stats["loss_harmless"] == pytest.approx(ls, rel=1e-6)
    assert loss.item() == pytest.approx((lh + 3 * ls) / 4, rel=1e-6)
    assert stats["beta_helpful_mean"] == pytest.approx(0.75) and stats["beta_harmless_mean"] == pytest.approx(
        0.5
    )
    # implicit rewards at the base beta, as dpo_loss reports them
    assert stats["reward_chosen"] == pytest.approx(0.5 * (1 + -1) / 2)
    assert stats["reward_margin"] == pytest.approx(0.5 * (2 + -1) / 2)
    assert stats["reward_accuracy"] == 0.5 and stats["num_pairs"] == 2


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0, 7.5])
def test_safe_mm_dpo_loss_matches_naive_reimplementation(lam):
    g = torch.Generator().manual_seed(int(lam * 10))
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    dh, ds = (
        torch.randn(6, generator=g, dtype=torch.float64) * 2,
        torch.randn(6, generator=g, dtype=torch.float64),
    )
    loss, stats = safe_mm_dpo_loss(pc, pr, rc, rr, dh, ds, lam=lam, beta=0.2, w=0.7, k=1.3)
    want, mh, ms = _naive_safe_mm(*(t.tolist() for t in (pc, pr, rc, rr, dh, ds)), lam, 0.2, 0.7, 1.3)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["loss_helpful"] == pytest.approx(mh, rel=1e-12)
    assert stats["loss_harmless"] == pytest.approx(ms, rel=1e-12)
    if lam == 0.0:  # no multiplier: the helpful loss alone
        assert loss.item() == pytest.approx(mh, rel=1e-12)


def test_safe_mm_dpo_gradient_is_the_lambda_mix_and_betas_carry_none():
    pc, pr, rc, rr = _pairs(requires_grad=True)
    dh = torch.tensor([1.0, 2.0], requires_grad=True)
    ds = torch.tensor([0.5, -3.0], requires_grad=True)
    loss, _ = safe_mm_dpo_loss(pc, pr, rc, rr, dh, ds, lam=2.0, beta=0.5, w=0.5, k=1.0)
    loss.backward()
    assert dh.grad is None and ds.grad is None  # the reward models' margins are targets
    grads = []
    for which in ("h", "s"):
        a, b, _, _ = _pairs(requires_grad=True)
        margin = dh.detach() if which == "h" else ds.detach()
        beta = mm_dpo_beta(margin, beta=0.5, w=0.5, k=1.0)
        d = (a - torch.tensor(RC)) - (b - torch.tensor(RR))
        (-torch.nn.functional.logsigmoid(beta * d).mean()).backward()
        grads.append(a.grad)
    torch.testing.assert_close(pc.grad, (grads[0] + 2.0 * grads[1]) / 3.0)
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises chosen, lowers rejected


def test_preferred_cost_by_hand():
    # equal mean log-probs: half each; a strong preference for chosen: chosen's cost
    cost = preferred_cost(
        torch.tensor([-1.0, -0.1, -5.0]),
        torch.tensor([-1.0, -9.0, -5.0 + math.log(3)]),
        torch.tensor([2.0, -1.0, 4.0]),
        torch.tensor([-2.0, 3.0, 0.0]),
    )
    # pair 3: softmax(-5, -5 + ln 3) = (1/4, 3/4) -> 4/4 + 0
    assert cost.tolist() == pytest.approx([0.0, -1.0 + 4 * 1 / (1 + math.exp(8.9)), 1.0], abs=1e-6)


def test_lagrange_update_by_hand_and_clamps():
    # ln lam' = ln lam + lr lam J
    assert lagrange_update(1.0, 0.5, lr=0.1) == pytest.approx(math.exp(0.05), rel=1e-15)
    assert lagrange_update(2.0, -1.0, lr=0.01) == pytest.approx(2.0 * math.exp(-0.02), rel=1e-15)
    assert lagrange_update(0.7, 0.0, lr=5.0) == 0.7  # at the threshold: unchanged
    assert lagrange_update(9.9, 100.0, lr=1.0) == 10.0  # clamped above (no overflow)
    assert lagrange_update(9.9, 1e300, lr=1.0) == 10.0
    assert lagrange_update(2e-6, -1e6, lr=1.0) == 1e-6  # clamped below
    assert lagrange_update(1.0, 3.0, lr=1.0, lambda_max=2.0) == 2.0
    assert lagrange_update(1.0, 3.0, lr=0.0) == 1.0
    # a naive re-implementation over a trajectory
    lam, naive = 1.0, 1.0
    for cost in (0.3, 0.8, -0.2, -1.5, 2.0):
        lam = lagrange_update(lam, cost, lr=0.2)
        naive = min(max(math.exp(math.log(naive) + 0.2 * naive * cost), 1e-6), 10.0)
        assert lam == pytest.approx(naive, rel=1e-14)


def test_safe_mm_bad_arguments():
    pc, pr, rc, rr = _pairs()
    two, three = torch.zeros(2), torch.zeros(3)
    with pytest.raises(ValueError, match="harmless_margin"):
        safe_mm_dpo_loss(pc, pr, rc, rr, two, three, lam=1.0, beta=0.1, w=0.5, k=0.5)
    with pytest.raises(ValueError, match="lam"):
        safe_mm_dpo_loss(pc, pr, rc, rr, two, two, lam=-1.0, beta=0.1, w=0.5, k=0.5)
    with pytest.raises(ValueError, match="beta"):
        mm_dpo_beta(two, beta=0.0, w=0.5, k=0.5)
    with pytest.raises(ValueError, match="w and k"):
        mm_dpo_beta(two, beta=0.1, w=-0.5, k=0.5)
    with pytest.raises(ValueError, match=r"\[B\]"):
        mm_dpo_beta(torch.zeros(2, 2), beta=0.1, w=0.5, k=0.5)
    with pytest.raises(ValueError, match="lam"):
        lagrange_update(0.0, 1.0, lr=0.1)
    with pytest.raises(ValueError, match="cost"):
        lagrange_update(1.0, float("nan"), lr=0.1)
    with pytest.raises(ValueError, match="lambda_min"):
        lagrange_update(1.0, 1.0, lr=0.1, lambda_min=2.0, lambda_max=1.0)
