"""Each rank's part of a global batch, cut into micro-batches that every rank runs in step.

DDP reduces gradients and ZeRO gathers parameters inside forward/backward, so every rank must run
the same number of micro-batches: a rank with fewer repeats its last one with weight 0 (its loss
and statistics count for nothing), and a rank with none runs a stand-in from the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from tandem.distributed.env import DistEnv

T = TypeVar("T")


def rank_slice(items: Sequence[T], env: DistEnv) -> list[T]:
    """This rank's part of a global batch: items rank, rank + world, ... (every rank holds the
    whole batch, so each also knows the global counts its loss divides by)."""
    return list(items[env.rank :: env.world_size])


def pad_micro_batches(
    micro_batches: list[list[T]], num_micro: int, *, stand_in: list[T], weight: float = 1.0
) -> list[tuple[list[T], float]]:
    """(micro-batch, weight) pairs, `num_micro` of them: `micro_batches` with `weight`, then weight-0
    repeats of the last one (of `stand_in` when there is none)."""
    out = [(micro, weight) for micro in micro_batches]
    while len(out) < num_micro:
        out.append((out[-1][0] if out else stand_in, 0.0))
    return out


def rank_micro_batches(
    batch: Sequence[T], micro_batch_size: int, env: DistEnv
) -> list[tuple[list[T], float]]:
    """This rank's (micro-batch, weight) pairs of a global batch split by rank_slice: as many as the
    fullest rank (rank 0) has, so a short or partial last batch keeps the ranks in step."""
    mine = rank_slice(batch, env)
    num_micro = math.ceil(math.ceil(len(batch) / env.world_size) / micro_batch_size)
    chunks = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    return pad_micro_batches(chunks, num_micro, stand_in=list(batch[:1]))
