"""A multi-turn episode's tool and environment tokens are context, never targets: the loss, its KL
term, its normaliser and every statistic cover the policy's own tokens only (Completion.policy_mask)."""

from __future__ import annotations

import torch

from tandem.algorithms.grpo import grpo_loss
from tandem.models.forward import packed_logprobs
from tandem.trainer.batching import (
    collate,
    flatten_groups,
    loss_normalizer,
    samples_from_tensors,
    samples_to_tensors,
)
from tandem.types import Completion, Group

PROMPT = [5, 6, 7]
# an episode: the policy's call (3 tokens), the tool's answer (4), the policy's reply (2)
EPISODE = [11, 12, 13, 40, 41, 42, 43, 14, 15]
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]


def episode_group(tool_logprob: float = 0.0, tool_ref: float = 0.0) -> Group:
    def completion(tokens, mask, advantage, seed):
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(len(tokens), generator=g) - 0.5
        ref = -torch.rand(len(tokens), generator=g) - 0.5
        if mask is not None:
            tool = torch.tensor(mask) == 0
            old[tool], ref[tool] = tool_logprob, tool_ref  # whatever a sampler puts there
        return Completion("", tokens, True, 0.0, {}, old, ref, advantage, policy_mask=mask)

    completions = [
        completion(EPISODE, MASK, 1.0, 0),
        completion([11, 16, 17, 18], None, -1.0, 1),  # a single-turn answer beside it
    ]
    return Group("g", "p", "", PROMPT, completions, 0)


def loss_and_grads(model, group, loss_agg="token-mean"):
    samples = flatten_groups([group], scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
    mb = collate(samples)
    model.zero_grad()
    logp = packed_logprobs(model, mb.packed)
    loss, stats = grpo_loss(
        logp,
        mb.sampler_logprobs,
        mb.ref_logprobs,
        mb.advantages,
        mb.loss_mask,
        kl_coef=0.1,
        loss_agg=loss_agg,
        normalizer=loss_normalizer(samples, loss_agg),
    )
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tool_tokens_contribute_exactly_zero(tiny_model):
    model = tiny_model.train()
    base_loss, base_stats, base = loss_and_grads(model, episode_group())
    # whatever log-probs the tool tokens carry, nothing changes, bit for bit
    loss, stats, grads = loss_and_grads(model, episode_group(tool_logprob=-40.0, tool_ref=3.0))
    assert torch.equal(loss, base_loss) and stats == base_stats
    assert all(torch.equal(grads[n], base[n]) for n in base)
    assert base_stats["num_tokens"] == sum(MASK) + 4


def test_the_loss_equals_one_over_the_policy_positions_alone(tiny_model):
    """An independent computation: the policy's positions picked by index, the token-mean GRPO
    objective with its k3 KL term written out (the first update: ratio 1 where the old log-probs are
    the trainer's own)."""
    model = tiny_model.train()
    group = episode_group()
    with torch.no_grad():  # make pi_old the current policy: ratio 1, as on the first update
        samples = flatten_groups([group], scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
        current = packed_logprobs(model, collate(samples).packed)
    for row, c in enumerate(group.completions):
        c.old_policy_log_probs = current[row, : len(c.generated_token_ids)].clone()
    loss, _, _ = loss_and_grads(model, group)

    model.zero_grad()
    logp = packed_logprobs(model, collate(samples).packed)
    total, count = 0.0, 0
    for row, c in enumerate(group.completions):
        positions = [
            t for t in range(len(c.generated_token_ids)) if c.policy_mask is None or c.policy_mask[t]
        ]
        for t in positions:
            new, ref = logp[row, t], c.ref_policy_log_probs[t]
            ratio = torch.exp(new - c.old_policy_log_probs[t])
            kl = torch.exp(ref - new) - (ref - new) - 1
            total = total - (ratio * c.advantage - 0.1 * kl)
            count += 1
    assert count == sum(MASK) + 4
    assert torch.allclose(loss, total / count, atol=1e-6)


def test_a_sequence_mean_averages_over_the_policys_tokens(tiny_model):
    """seq-mean-token-mean: an episode's mean is over its 5 policy tokens, not its 9 tokens."""
    _, stats, _ = loss_and_grads(tiny_model.train(), episode_group(), loss_agg="seq-mean-token-mean")
    samples = flatten_groups([episode_group()], scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
    mb = collate(samples)
    assert mb.completion_mask[0].tolist() == [bool(m) for m in MASK]
    assert loss_normalizer(samples, "token-mean") == sum(MASK) + 4
    assert loss_normalizer(samples, "seq-mean-token-mean") == 2


def test_masks_survive_the_split_across_ranks():
    samples = flatten_groups([episode_group()], scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
    back = samples_from_tensors(samples_to_tensors(samples))
    assert back[0].policy_mask.tolist() == [bool(m) for m in MASK]
    assert back[1].policy_mask.tolist() == [True] * 4  # unmasked samples travel as all-policy
    single = flatten_groups(
        [Group("g", "p", "", PROMPT, [episode_group().completions[1]] * 2, 0)],
        scale_rewards="group",
        adv_eps=1e-4,
        skip_zero_variance=False,
    )
    assert all(s.policy_mask is None for s in samples_from_tensors(samples_to_tensors(single)))
