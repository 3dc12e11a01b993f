"""PPO maths: GAE against a per-sequence loop, whitening, clipped policy/value losses, KL rewards."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.ppo import gae, kl_penalized_rewards, ppo_policy_loss, value_loss, whiten


def test_gae_by_hand():
    # row 0, gamma 1, lam 0.5: rewards [0, 0, 1], values [0.5, 0.5, 0.5]
    #   t=2: delta = 1 + 0 - 0.5 = 0.5          A = 0.5
    #   t=1: delta = 0 + 0.5 - 0.5 = 0           A = 0 + 0.5 * 0.5 = 0.25
    #   t=0: delta = 0                           A = 0.5 * 0.25 = 0.125
    #   returns = A + V = [0.625, 0.75, 1.0]
    # row 1 has one valid token; the padding holds garbage that must not leak in:
    #   t=0: delta = 1 + 0 (terminal) - 0.2 = 0.8, returns 1.0; padding -> 0
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 5.0, 7.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.125, 0.25, 0.5], [0.8, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.625, 0.75, 1.0], [1.0, 0.0, 0.0]]))
    # lam = 1, gamma = 1: returns are the reward-to-go (Monte Carlo), A = 1 - 0.5 everywhere in row 0
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages[0], torch.tensor([0.5, 0.5, 0.5]))
    torch.testing.assert_close(returns[0], torch.tensor([1.0, 1.0, 1.0]))
    # gamma 0.5, lam 0 (one-step TD): A_t = r_t + 0.5 V_{t+1} - V_t = [-0.25, -0.25, 0.5]
    advantages, _ = gae(rewards, values, mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(advantages[0], torch.tensor([-0.25, -0.25, 0.5]))


def _naive_gae(rewards, values, lengths, gamma, lam):
    """Sequence-by-sequence loop over the valid tokens only (right padding)."""
    advantages, returns = [], []
    for r, v, n in zip(rewards, values, lengths):
        adv = [0.0] * len(r)
        running = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return advantages, returns


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (0.0, 0.5), (0.8, 0.7)])
def test_gae_matches_naive_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    batch, width = 7, 9
    rewards = torch.randn(batch, width, generator=g, dtype=torch.float64)
    values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,), generator=g).tolist()
    lengths[0], lengths[1] = 1, width  # the edge cases: one valid token, no padding
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = _naive_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(
        advantages, torch.tensor(expected_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        returns, torch.tensor(expected_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )


def test_gae_left_padding_gives_the_same_numbers_and_zero_padding():
    # the same sequence right- and left-padded: the valid tokens' values agree, padding is 0
    # (left of a left-padded sequence delta = gamma V_first != 0, so the mask must zero it)
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(1, 4, generator=g, dtype=torch.float64)
    values = torch.randn(1, 4, generator=g, dtype=torch.float64)
    right = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    left = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    adv_right, ret_right = gae(rewards, values, right, gamma=0.9, lam=0.8)
    adv_left, ret_left = gae(rewards.roll(1, dims=1), values.roll(1, dims=1), left, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv_left, adv_right.roll(1, dims=1))
    torch.testing.assert_close(ret_left, ret_right.roll(1, dims=1))
    assert adv_left[0, 0] == 0 and ret_left[0, 0] == 0


def test_gae_outputs_are_targets_without_gradient():
    values = torch.randn(2, 4, requires_grad=True)
    advantages, returns = gae(torch.ones(2, 4), values, torch.ones(2, 4, dtype=torch.bool))
    assert not advantages.requires_grad and not returns.requires_grad


def test_whiten_by_hand():
    # kept [1, 2, 3]: mean 2, population var (1 + 0 + 1) / 3 = 2/3 -> [-1, 0, 1] / sqrt(2/3) = [-1.224745, 0, 1.224745]
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    scale = 1 / math.sqrt(2 / 3)
    torch.testing.assert_close(
        whiten(x, mask, eps=0.0), torch.tensor([[-scale, 0.0, scale, 0.0]], dtype=torch.float64)
    )
    # shift_mean=False adds the mean 2 back: [0.775255, 2, 3.224745, 0]
    torch.testing.assert_close(
        whiten(x, mask, shift_mean=False, eps=0.0),
        torch.tensor([[2 - scale, 2.0, 2 + scale, 0.0]], dtype=torch.float64),
    )


def test_whiten_with_the_moments_of_a_larger_batch_equals_whitening_it_whole():
    # two micro-batches [1, 2] and [3, (100 masked)]: whole-batch mean 2, var 2/3, as above
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    parts = [whiten(x[i : i + 1], mask[i : i + 1], eps=0.0, moments=(2.0, 2 / 3)) for i in range(2)]
    torch.testing.assert_close(torch.cat(parts), whiten(x, mask, eps=0.0))


def test_whiten_random_has_zero_mean_unit_variance_on_the_mask():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64) * 4 + 3
    mask = torch.rand(5, 6, generator=g) < 0.6
    out = whiten(x, mask, eps=0.0)
    kept = out[mask]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert kept.var(unbiased=False).item() == pytest.approx(1.0, rel=1e-12)
    assert (out[~mask] == 0).all()


# policy-loss example: eps 0.2, mask keeps 4 tokens
#   (ratio 1.5, A +1): max(-1.5, -1.2) = -1.2  clipped
#   (ratio 0.5, A +1): max(-0.5, -0.8) = -0.5  not clipped (pessimistic bound)
#   (ratio 0.5, A -1): max( 0.5,  0.8) =  0.8  clipped
#   (ratio 1.5, A -1): max( 1.5,  1.2) =  1.5  not clipped
# sum = 0.6 -> token mean 0.15 ; clip_fraction 2/4
# approx_kl: (r - 1) - log r: 1.5 -> 0.5 - 0.405465 = 0.094535 ; 0.5 -> -0.5 + 0.693147 = 0.193147
#   mean = (2 * 0.094535 + 2 * 0.193147) / 4 = 0.143841
def _policy_example():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.5], [1.5, 3.0, 3.0]]))
    old = torch.zeros(2, 3)
    advantages = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return logprobs, old, advantages, mask


def test_ppo_policy_loss_by_hand():
    loss, stats = ppo_policy_loss(*_policy_example(), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["approx_kl"] == pytest.approx((0.5 - math.log(1.5) + math.log(2) - 0.5) / 2, abs=1e-6)
    assert stats["num_tokens"] == 4.0
    # a global normaliser of 8 tokens halves it
    loss, _ = ppo_policy_loss(*_policy_example(), clip_eps=0.2, normalizer=8.0)
    assert loss.item() == pytest.approx(0.075, abs=1e-6)


def test_ppo_policy_gradient_on_policy_and_clipped():
    # ratio 1: dL/dlogp = -A / N ; clipped tokens get no gradient
    logprobs = torch.zeros(1, 3, requires_grad=True)
    advantages = torch.tensor([[2.0, -1.0, 4.0]])
    ppo_policy_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, 3, dtype=torch.bool))[0].backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 1.0, -4.0]]) / 3)
    logprobs, old, advantages, mask = _policy_example()
    logprobs.requires_grad_(True)
    ppo_policy_loss(logprobs, old, advantages, mask)[0].backward()
    # token 2: d(-A r)/dlogp = -A r / 4 = -0.5 / 4 ; token 4: 1.5 / 4 ; clipped and masked: 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.125, 0.0], [0.375, 0.0, 0.0]]))


def _naive_policy_loss(new, old, adv, mask, eps):
    total, count = 0.0, 0
    for i in range(len(new)):
        for t in range(len(new[i])):
            if mask[i][t]:
                r = math.exp(new[i][t] - old[i][t])
                total += max(-adv[i][t] * r, -adv[i][t] * min(max(r, 1 - eps), 1 + eps))
                count += 1
    return total / count


def _random_tokens(seed, batch=6, width=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, width, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(batch, width, generator=g, dtype=torch.float64) * 0.3
    advantages = torch.randn(batch, width, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return new, old, advantages, mask


def test_ppo_policy_loss_matches_naive_and_splits_into_micro_batches():
    new, old, advantages, mask = _random_tokens(0)
    new.requires_grad_(True)
    full, _ = ppo_policy_loss(new, old, advantages, mask, clip_eps=0.15)
    expected = _naive_policy_loss(new.tolist(), old.tolist(), advantages.tolist(), mask.tolist(), 0.15)
    assert full.item() == pytest.approx(expected, rel=1e-12)
    full.backward()
    full_grad, new.grad = new.grad.clone(), None
    parts = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part, _ = ppo_policy_loss(
            new[rows], old[rows], advantages[rows], mask[rows], clip_eps=0.15, normalizer=float(mask.sum())
        )
        part.backward()
        parts += part.item()
    assert parts == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(new.grad, full_grad)


def test_value_loss_by_hand():
    # old 0, eps 0.2:
    #   v 0.5, R 1: (0.5)^2 = 0.25 vs clipped v 0.2: (0.8)^2 = 0.64 -> 0.5 * 0.64 = 0.32   (clipped binds)
    #   v 0.5, R 0: 0.25 vs (0.2)^2 = 0.04                           -> 0.5 * 0.25 = 0.125
    #   v 0.1, R 1: inside the clip: 0.81                            -> 0.405
    # token mean (0.32 + 0.125 + 0.405) / 3 = 0.283333 ; value_mse (0.25 + 0.25 + 0.81) / 3 = 0.436667
    values = torch.tensor([[0.5, 0.5, 0.1, 7.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 0.0, 1.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.85 / 3, abs=1e-6)
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["value_mse"] == pytest.approx(1.31 / 3, abs=1e-6)
    loss.backward()
    # clipped token: no gradient; others (v - R) / 3: 0.5 / 3, -0.9 / 3 ; masked 0
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5 / 3, -0.3, 0.0]]))
    # normalizer
    loss, _ = value_loss(values, old, returns, mask, clip_eps=0.2, normalizer=10.0)
    assert loss.item() == pytest.approx(0.085, abs=1e-6)


def test_kl_penalized_rewards_by_hand():
    # kl_coef 0.1
    # row 0: -0.1 * [(-1 + 1.5), (-2 + 2)] = [-0.05, 0], last valid token t=1 gets +2 -> [-0.05, 2, 0]
    # row 1: -0.1 * (-1 - 0) = 0.1 per token, last t=2 gets -1 -> [0.1, 0.1, -0.9]
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    rewards = kl_penalized_rewards(torch.tensor([2.0, -1.0]), logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 2.0, 0.0], [0.1, 0.1, -0.9]]))
    assert not rewards.requires_grad
    # through GAE with gamma = lam = 1 and zero values, the advantages are the reward-to-go
    advantages, _ = gae(rewards, torch.zeros(2, 3), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.95, 2.0, 0.0], [-0.7, -0.8, -0.9]]))


def test_bad_arguments():
    ones = torch.ones(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="values"):
        gae(ones, torch.ones(2, 4), mask)
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.ones(6), torch.ones(6), torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="gamma"):
        gae(ones, ones, mask, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        gae(ones, ones, mask, lam=-0.1)
    with pytest.raises(ValueError, match="mask"):
        whiten(ones, mask[:, :2])
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(ones, ones, torch.ones(2), mask)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_policy_loss(ones, ones, ones, mask, clip_eps=-0.1)
    with pytest.raises(ValueError, match="returns"):
        value_loss(ones, ones, torch.ones(3, 2), mask)
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(torch.ones(3), ones, ones, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="at least one valid token"):
        kl_penalized_rewards(torch.ones(2), ones, ones, torch.tensor([[1, 0, 0], [0, 0, 0]]), kl_coef=0.1)
