"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): groups without a learning signal are
replaced by groups of fresh prompts before they reach the trainer.

A group whose scored rewards all agree (or that has fewer than two scored completions) has zero
advantage for every completion: it costs the trainer a forward and backward pass and moves nothing.
DAPO over-samples and keeps the groups with 0 < accuracy < 1 until the batch is full; here the
producer of groups (a sampler process, or the colocated rollout) does the same, one share of a
batch at a time, so the trainer's pacing and batch size are unchanged: it simply receives
informative groups.

The extra generation is capped: at most `max_extra` groups are dropped per share (DAPO caps the
number of generation rounds). Once a share's cap is spent the remaining groups of that share are
kept as they come, so a model that solves (or fails) everything still trains, with the zero-variance
groups it has. Each kept group carries in `Group.filtered` the count and generated tokens of the
groups dropped since the previous kept one, which the trainer sums into `groups_filtered` and
`generation_overhead`.
"""

from __future__ import annotations

import math

from tandem.config import Config
from tandem.types import Group

DEFAULT_EXTRA_PER_PROMPT = 3  # grpo.dynamic_sampling_max_extra_prompts: null = 3 x prompts_per_step


def informative(group: Group) -> bool:
    """True when the group's scored rewards differ (some completion has a non-zero advantage)."""
    return len(set(group.scored_rewards)) > 1


def max_extra_prompts(cfg: Config, num_samplers: int = 1) -> int:
    """One producer's cap on dropped groups per share of a batch: the configured per-batch cap
    (null: 3 x prompts_per_step), split evenly between `num_samplers`, rounded up."""
    per_batch = cfg.grpo.dynamic_sampling_max_extra_prompts
    if per_batch is None:
        per_batch = DEFAULT_EXTRA_PER_PROMPT * cfg.prompts_per_step
    return math.ceil(per_batch / num_samplers)


class GroupFilter:
    """Keeps informative groups, drops the others while a share's cap allows.

    `share` groups make one share of a batch (a sampler's quota per trainer batch, or the whole
    batch when colocated); `max_extra` groups may be dropped per share. State: the kept count
    (which share we are in), the drops of this share, and the drops not yet reported on a kept group.
    """

    def __init__(self, share: int, max_extra: int) -> None:
        self.share, self.max_extra = share, max_extra
        self.kept = 0
        self.dropped_in_share = 0
        self.pending = {"groups": 0, "tokens": 0}
        self.generated_total = 0
        self.filtered_total = 0

    def admit(self, groups: list[Group]) -> list[Group]:
        """The groups to send, in order; each kept group's `filtered` holds the drops before it."""
        kept = []
        for group in groups:
            self.generated_total += 1
            if not informative(group) and self.dropped_in_share < self.max_extra:
                self.dropped_in_share += 1
                self.filtered_total += 1
                self.pending["groups"] += 1
                self.pending["tokens"] += sum(len(c.generated_token_ids) for c in group.completions)
                continue
            if self.pending["groups"]:
                group.filtered = dict(self.pending)
                self.pending = {"groups": 0, "tokens": 0}
            kept.append(group)
            self.kept += 1
            if self.kept % self.share == 0:  # a share is complete: the next one has its own cap
                self.dropped_in_share = 0
        return kept

    def state_dict(self) -> dict:
        return {
            "kept": self.kept,
            "dropped_in_share": self.dropped_in_share,
            "pending": dict(self.pending),
            "generated_total": self.generated_total,
            "filtered_total": self.filtered_total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.kept = int(state["kept"])
        self.dropped_in_share = int(state["dropped_in_share"])
        self.pending = {"groups": int(state["pending"]["groups"]), "tokens": int(state["pending"]["tokens"])}
        self.generated_total = int(state.get("generated_total", 0))
        self.filtered_total = int(state.get("filtered_total", 0))


def filtered_fields(groups: list[Group]) -> dict:
    """A trainer row's dynamic-sampling fields for the groups of its batch: groups dropped while they
    were made (`groups_filtered`), all groups made (`groups_generated`), and the extra generation
    that cost, as generated tokens dropped per generated token trained on (`generation_overhead`:
    0.5 = half again as much generation as without dynamic sampling)."""
    dropped = sum(g.filtered.get("groups", 0) for g in groups)
    dropped_tokens = sum(g.filtered.get("tokens", 0) for g in groups)
    tokens = sum(len(c.generated_token_ids) for g in groups for c in g.completions)
    return {
        "groups_filtered": dropped,
        "groups_generated": len(groups) + dropped,
        "generation_overhead": dropped_tokens / tokens if tokens else 0.0,
    }
