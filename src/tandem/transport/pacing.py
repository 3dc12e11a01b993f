"""The staleness contract between trainer and samplers (DESIGN.md section 4), as pure functions.

The trainer publishes a version every `sync_every` optimizer steps (`publishes_at`) and announces
at which versions it will take its next batches (`announce`); a sampler holding version K makes
its share of each batch that will still find K fresh (`groups_allowed`, `batch_share`); the
trainer drops a group older than `max_staleness` versions, or from a lost future (`drop_reason`).
tests/unit/test_pacing_contract.py checks them together: what a sampler may make is never dropped.
"""

from __future__ import annotations

import math

from tandem.types import TrainerStatus

MAX_TAKES_ANNOUNCED = 256  # sync_every far above the steps per batch could ask for many


def publishes_at(step: int, sync_every: int, *, decoupled: bool = True) -> bool:
    """Whether optimizer step `step` ends with a weight publish to the samplers (decoupled runs,
    every `sync_every` steps). Every rank can tell, so under ZeRO-3 the ranks gather the full
    parameters only for the steps that publish, not after every step."""
    return decoupled and step % sync_every == 0


def version_base(version: int, step: int, sync_every: int) -> int:
    """The version the trainer held at step 0 of this process: version = base + step // sync_every
    (a restarted trainer continues after the versions it published before)."""
    return version - step // sync_every


def announce(
    base: int, take_step: int, steps_per_batch: int, *, version: int, sync_every: int, max_staleness: int
) -> tuple[int, ...]:
    """The versions at which the trainer takes its next batches, the first at optimizer step
    `take_step` and one every `steps_per_batch` steps after, as far as a sampler holding the
    newest `version` could make groups for (staleness included): every take up to the first one
    past version + max_staleness + 1, at least one, at most MAX_TAKES_ANNOUNCED."""
    horizon = version + max_staleness + 1
    takes: list[int] = []
    while len(takes) < MAX_TAKES_ANNOUNCED:
        take = base + take_step // sync_every
        if takes and take > horizon:
            break
        takes.append(take)
        take_step += steps_per_batch
    return tuple(takes)


def batch_share(prompts_per_step: int, num_samplers: int) -> int:
    """Groups the trainer takes from one sampler per batch: Q = ceil(prompts_per_step / num_samplers)."""
    return math.ceil(prompts_per_step / num_samplers)


def groups_allowed(
    status: TrainerStatus, version: int, first_batch: int, share: int, max_staleness: int
) -> int:
    """Groups a sampler holding `version` may have made since it joined the trainer's run at batch
    `first_batch`: its share of every batch taken since, and of each announced one that will still
    find them fresh."""
    fresh_until = version + max_staleness
    return share * (status.batches - first_batch + sum(v <= fresh_until for v in status.take_versions))


def age(version: int, policy_version: int, resumed: tuple[int, int] | None = None) -> int | None:
    """How many versions a group made by `policy_version` is behind a trainer holding `version`.

    A resumed trainer (`resumed` = (version of its checkpoint, first version it published)) threw
    away the weights published after its checkpoint: a group made by one of those is of no lineage
    the trainer continues (None), and a group made before the checkpoint is as old as its distance
    to the checkpoint plus the versions published since the restart (the first of which holds the
    checkpoint's weights)."""
    if resumed is not None:
        checkpoint, first = resumed
        if checkpoint < policy_version < first:
            return None
        if policy_version <= checkpoint:
            return (version - first) + (checkpoint - policy_version)
    return version - policy_version


def drop_reason(
    version: int, policy_version: int, max_staleness: int, resumed: tuple[int, int] | None = None
) -> str | None:
    """Why a trainer holding `version` drops a group made by `policy_version`: "discarded" (made by
    weights a resume threw away, see `age`), "future" (made by weights of a trainer run that was
    lost), "stale" (more than `max_staleness` versions old), or None: it trains on it."""
    behind = age(version, policy_version, resumed)
    if behind is None:
        return "discarded"
    if behind < 0:
        return "future"
    if behind > max_staleness:
        return "stale"
    return None
