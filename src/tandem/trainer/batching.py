"""Groups -> padded training micro-batches, with the global counts the loss divides by."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.algorithms.grpo import group_advantages
from tandem.models.forward import PackedRows, pack_rows
from tandem.types import Group


@dataclass
class Sample:
    """One completion flattened out of its group, ready to be batched."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: torch.Tensor  # [T]
    ref_logprobs: torch.Tensor | None  # [T]
    advantage: float
    policy_version: int
    group_index: int  # samples of one group share a packed row (their prompt is computed once)
    reward: float = 0.0  # the completion's total reward (PPO scores the sequence with it)
    # [T] pi_old as the trainer computed it (grpo.old_logprobs: trainer); None: sampler_logprobs is
    old_logprobs: torch.Tensor | None = None
    # out of the loss and its normalisers (grpo.mask_truncated_completions: cut at max_new_tokens)
    masked: bool = False
    # [T] bool: the policy's own tokens of a multi-turn episode (Completion.policy_mask); None: all
    policy_mask: torch.Tensor | None = None

    @property
    def num_policy_tokens(self) -> int:
        """The tokens the loss can see: every token, or the policy's of an episode."""
        return len(self.completion_ids) if self.policy_mask is None else int(self.policy_mask.sum())


@dataclass
class MicroBatch:
    packed: PackedRows  # prompt + completions rows, completions in sample order
    completion_mask: torch.Tensor  # [B, T] the policy's tokens (an episode's tool tokens are 0)
    sampler_logprobs: torch.Tensor  # [B, T]
    ref_logprobs: torch.Tensor | None  # [B, T]
    advantages: torch.Tensor  # [B]
    old_logprobs: torch.Tensor | None = None  # [B, T] the trainer's pi_old, when every sample has one
    # [B, T] the tokens the loss keeps: completion_mask less the masked samples' rows (Sample.masked)
    loss_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(*(None if t is None else t.to(device) for t in self.__dict__.values()))


def flatten_groups(
    groups: list[Group],
    *,
    scale_rewards: str,
    adv_eps: float,
    skip_zero_variance: bool,
    mask_truncated: bool = False,
) -> list[Sample]:
    """Samples of every group, in order; batch reward scaling is applied here, across all groups.
    `mask_truncated` (DAPO's overlong filtering): a completion cut at max_new_tokens (no EOS) is a
    masked sample, out of the loss; its reward still counts in its group's advantages."""
    if scale_rewards == "batch" and groups:
        # unscored completions (every reward None) as NaN: out of the statistics, advantage 0
        rewards = torch.tensor([c.reward if c.scored else math.nan for g in groups for c in g.completions])
        advantages = group_advantages(
            rewards, len(groups[0].completions), scale="batch", eps=adv_eps
        ).tolist()
    else:
        advantages = [c.advantage for g in groups for c in g.completions]
    samples, k = [], 0
    for index, g in enumerate(groups):
        flat = len(set(g.scored_rewards)) <= 1
        for c in g.completions:
            if not (skip_zero_variance and flat):
                samples.append(
                    Sample(
                        g.prefix_token_ids,
                        c.generated_token_ids,
                        c.old_policy_log_probs,
                        c.ref_policy_log_probs,
                        advantages[k],
                        g.policy_version,
                        index,
                        c.reward,
                        masked=mask_truncated and not c.is_finished,
                        policy_mask=None
                        if c.policy_mask is None
                        else torch.tensor(c.policy_mask, dtype=torch.bool),
                    )
                )
            k += 1
    return samples


def collate(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    """Pack a micro-batch; samples of one group must be adjacent (split_micro_batches keeps them so)."""
    rows: list[tuple[list[int], list[list[int]]]] = []
    for i, s in enumerate(samples):
        if i == 0 or s.group_index != samples[i - 1].group_index:
            rows.append((s.prompt_ids, []))
        rows[-1][1].append(s.completion_ids)
    completion_lengths = torch.tensor([len(s.completion_ids) for s in samples])
    width = int(completion_lengths.max())
    mask = torch.arange(width)[None, :] < completion_lengths[:, None]
    for i, s in enumerate(samples):  # an episode's tool and environment tokens: context, not targets
        if s.policy_mask is not None:
            mask[i, : len(s.policy_mask)] &= s.policy_mask

    def pad(rows: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out

    has_ref = all(s.ref_logprobs is not None for s in samples)
    has_old = all(s.old_logprobs is not None for s in samples)
    kept = torch.tensor([not s.masked for s in samples])
    return MicroBatch(
        packed=pack_rows(rows, pad_id),
        completion_mask=mask,
        sampler_logprobs=pad([s.sampler_logprobs for s in samples]),
        ref_logprobs=pad([s.ref_logprobs for s in samples]) if has_ref else None,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        old_logprobs=pad([s.old_logprobs for s in samples]) if has_old else None,
        loss_mask=mask if bool(kept.all()) else mask & kept[:, None],
    )


def split_micro_batches(samples: list[Sample], micro_batch_size: int) -> list[list[Sample]]:
    """Chunks of at most micro_batch_size sequences; a group's samples stay adjacent, and groups
    of similar total length go together so little of a packed micro-batch is padding.

    The loss is normalised by global counts, so the grouping changes only summation order.
    """
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s)

    def group_tokens(group: list[Sample]) -> int:
        return len(group[0].prompt_ids) + sum(len(s.completion_ids) for s in group)

    ordered = [s for group in sorted(by_group.values(), key=group_tokens) for s in group]
    return [ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]


def loss_normalizer(samples: list[Sample], loss_agg: str) -> float:
    """The count the loss of a whole optimizer batch divides by (DESIGN.md section 6): its tokens
    (token-mean) or sequences (the others). Masked samples (Sample.masked) are not in the loss, so
    not in the count: the update is as if they were not in the batch."""
    if loss_agg == "token-mean":
        return float(sum(s.num_policy_tokens for s in samples if not s.masked))
    return float(sum(not s.masked for s in samples))


def split_across_ranks(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Whole groups to ranks, balancing tokens: the largest group goes to the lightest rank
    next (longest-processing-time first). A rank's samples keep their original order."""
    if world_size == 1:
        return [samples]
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_index, []).append(s)

    def tokens(group: list[Sample]) -> int:
        return len(group[0].prompt_ids) + sum(len(s.completion_ids) for s in group)

    loads, owner = [0] * world_size, {}
    for index, group in sorted(by_group.items(), key=lambda kv: (-tokens(kv[1]), kv[0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += tokens(group)
        owner[index] = rank
    shares: list[list[Sample]] = [[] for _ in range(world_size)]
    for s in samples:
        shares[owner[s.group_index]].append(s)
    return shares


def samples_to_tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Flat named tensors (no pickling) for sending a rank its share; inverse of samples_from_tensors."""

    def ints(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    def floats(rows) -> torch.Tensor:
        rows = [r.reshape(-1).float() for r in rows]
        return torch.cat(rows) if rows else torch.zeros(0)

    has_ref = bool(samples) and all(s.ref_logprobs is not None for s in samples)
    return {
        "prompt_lengths": ints(len(s.prompt_ids) for s in samples),
        "completion_lengths": ints(len(s.completion_ids) for s in samples),
        "prompt_ids": ints(t for s in samples for t in s.prompt_ids),
        "completion_ids": ints(t for s in samples for t in s.completion_ids),
        "sampler_logprobs": floats(s.sampler_logprobs for s in samples),
        "ref_logprobs": floats(s.ref_logprobs for s in samples) if has_ref else torch.zeros(0),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "policy_versions": ints(s.policy_version for s in samples),
        "group_indices": ints(s.group_index for s in samples),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "masked": ints(int(s.masked) for s in samples),
        "has_ref": ints([int(has_ref)]),
        # 1 per completion token (all 1 for a sample without a mask), when any sample has one
        "policy_mask": (
            ints(
                t
                for s in samples
                for t in (
                    s.policy_mask.tolist() if s.policy_mask is not None else [1] * len(s.completion_ids)
                )
            )
            if any(s.policy_mask is not None for s in samples)
            else torch.zeros(0, dtype=torch.int64)
        ),
    }


def samples_from_tensors(t: dict[str, torch.Tensor]) -> list[Sample]:
    prompt_lengths, completion_lengths = t["prompt_lengths"].tolist(), t["completion_lengths"].tolist()
    prompt_ids, completion_ids = t["prompt_ids"].tolist(), t["completion_ids"].tolist()
    has_ref = bool(t["has_ref"][0])
    masked = t["masked"].tolist()
    masks = t["policy_mask"].bool() if t["policy_mask"].numel() else None
    samples, p, c = [], 0, 0
    for i, (n_prompt, n_completion) in enumerate(zip(prompt_lengths, completion_lengths)):
        samples.append(
            Sample(
                prompt_ids[p : p + n_prompt],
                completion_ids[c : c + n_completion],
                t["sampler_logprobs"][c : c + n_completion].clone(),
                t["ref_logprobs"][c : c + n_completion].clone() if has_ref else None,
                float(t["advantages"][i]),
                int(t["policy_versions"][i]),
                int(t["group_indices"][i]),
                float(t["rewards"][i]),
                masked=bool(masked[i]),
                policy_mask=None if masks is None else masks[c : c + n_completion].clone(),
            )
        )
        p, c = p + n_prompt, c + n_completion
    return samples
