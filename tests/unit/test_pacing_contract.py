"""The staleness contract of transport/pacing.py, its functions taken together as the trainer and the
samplers use them: what the trainer announces (`announce`, `version_base`, `publishes_at`), what a
sampler may make (`groups_allowed`, `batch_share`) and what the trainer drops (`drop_reason`).

The contract: when every batch the trainer takes holds each sampler's share Q = ceil(prompts_per_step
/ num_samplers) of groups (prompts_per_step divisible by num_samplers, samplers equally fast; else
the trainer's `starved` status covers the difference), a sampler that makes all it is allowed with
the newest weights (1) never makes a group the trainer drops and (2) has always made the groups a
batch needs before the trainer takes it, whatever the steps per batch, sync_every and max_staleness.
"""

from __future__ import annotations

import itertools

import pytest

from tandem.transport.pacing import (
    MAX_TAKES_ANNOUNCED,
    age,
    announce,
    batch_share,
    drop_reason,
    groups_allowed,
    publishes_at,
    version_base,
)
from tandem.types import TrainerStatus

PROMPTS_PER_STEP = (1, 2, 3, 4, 6)
NUM_SAMPLERS = (1, 2, 3)
NUM_BATCHES = 8


class Trainer:
    """The trainer's side as trainer/experience.py runs it: a schedule announced at each take and
    each publish, one version every `sync_every` optimizer steps, `steps_per_batch` steps a batch."""

    def __init__(self, version: int, sync_every: int, steps_per_batch: int, max_staleness: int) -> None:
        self.version, self.sync_every, self.steps_per_batch = version, sync_every, steps_per_batch
        self.max_staleness = max_staleness
        self.step = self.batches = 0
        self.schedule = (version_base(version, 0, sync_every), 0, steps_per_batch)  # expect(0, 0, K)
        self.takes = self._announce()

    def _announce(self) -> tuple[int, ...]:
        return announce(
            *self.schedule, version=self.version, sync_every=self.sync_every, max_staleness=self.max_staleness
        )

    def status(self) -> TrainerStatus:
        return TrainerStatus(self.version, "run", batches=self.batches, take_versions=self.takes)

    def took_batch(self) -> None:  # next_groups, then expect(step, K, K)
        self.batches += 1
        base = version_base(self.version, self.step, self.sync_every)
        self.schedule = (base, self.step + self.steps_per_batch, self.steps_per_batch)
        self.takes = self._announce()

    def optimizer_step(self) -> None:  # on_step
        self.step += 1
        if publishes_at(self.step, self.sync_every):
            self.version += 1
            self.takes = self._announce()


def make_all_allowed(trainer: Trainer, queues: list[list[int]], made: list[int], share: int) -> None:
    """Every sampler makes all it may with the trainer's newest version (joined at batch 0)."""
    status = trainer.status()
    for i, queue in enumerate(queues):
        allowed = groups_allowed(status, status.version, 0, share, trainer.max_staleness)
        while made[i] < allowed:
            queue.append(status.version)
            made[i] += 1


@pytest.mark.parametrize("start_version", [0, 5])  # 5: a trainer restarted after publishing v0..v4
@pytest.mark.parametrize(
    ("steps_per_batch", "sync_every", "max_staleness"),
    list(itertools.product((1, 2, 4), (1, 2, 3), (0, 1, 2))),
)
def test_what_a_sampler_may_make_is_never_dropped(start_version, steps_per_batch, sync_every, max_staleness):
    for prompts_per_step, num_samplers in itertools.product(PROMPTS_PER_STEP, NUM_SAMPLERS):
        case = f"prompts_per_step={prompts_per_step} num_samplers={num_samplers}"
        share = batch_share(prompts_per_step, num_samplers)
        trainer = Trainer(start_version, sync_every, steps_per_batch, max_staleness)
        queues: list[list[int]] = [[] for _ in range(num_samplers)]
        made = [0] * num_samplers
        make_all_allowed(trainer, queues, made, share)
        for batch in range(NUM_BATCHES):
            for queue in queues:
                assert len(queue) >= share, f"{case}: batch {batch} waits for groups the sampler may not make"
                taken, queue[:] = queue[:share], queue[share:]
                for policy_version in taken:
                    reason = drop_reason(trainer.version, policy_version, max_staleness)
                    assert reason is None, f"{case}: batch {batch} drops a v{policy_version} group ({reason})"
            trainer.took_batch()
            make_all_allowed(trainer, queues, made, share)
            for _ in range(steps_per_batch):
                trainer.optimizer_step()
                make_all_allowed(trainer, queues, made, share)
        # nothing made in vain: each group in flight is still fresh when its batch is taken
        base = version_base(trainer.version, trainer.step, sync_every)
        for queue in queues:
            for j, policy_version in enumerate(queue):
                take_version = base + (trainer.step + (j // share) * steps_per_batch) // sync_every
                assert drop_reason(take_version, policy_version, max_staleness) is None, case


@pytest.mark.parametrize(
    ("prompts_per_step", "num_samplers"), list(itertools.product(PROMPTS_PER_STEP, NUM_SAMPLERS))
)
def test_the_samplers_shares_cover_a_batch_with_less_than_one_group_each_to_spare(
    prompts_per_step, num_samplers
):
    share = batch_share(prompts_per_step, num_samplers)
    assert prompts_per_step <= share * num_samplers < prompts_per_step + num_samplers


def test_the_trainer_drops_old_groups_and_those_of_a_lost_future():
    assert drop_reason(5, 5, 0) is None and drop_reason(5, 4, 1) is None
    assert drop_reason(5, 4, 0) == "stale" and drop_reason(5, 2, 2) == "stale"
    assert drop_reason(5, 6, 3) == "future"


def test_an_announcement_holds_the_next_take_and_every_one_a_fresh_group_could_reach():
    # version 3 at step 6, sync_every 2 (base 0); takes every 4 steps from step 8: versions 4, 6, 8, ...
    assert version_base(3, 6, 2) == 0
    assert announce(0, 8, 4, version=3, sync_every=2, max_staleness=1) == (4,)  # horizon 3 + 1 + 1 = 5
    assert announce(0, 8, 4, version=3, sync_every=2, max_staleness=3) == (4, 6)
    # far past the horizon, the next take is still announced; a batch of many takes, capped
    assert announce(0, 40, 4, version=3, sync_every=2, max_staleness=0) == (20,)
    assert len(announce(0, 0, 1, version=10**6, sync_every=1, max_staleness=0)) == MAX_TAKES_ANNOUNCED


def test_weights_are_published_every_sync_every_steps_of_a_decoupled_run_only():
    assert [s for s in range(1, 10) if publishes_at(s, 3)] == [3, 6, 9]
    assert not any(publishes_at(s, 1, decoupled=False) for s in range(1, 5))


def test_after_a_resume_groups_of_discarded_weights_are_dropped_and_older_ones_aged_by_lineage():
    """A trainer checkpointed at version 4, killed after publishing 5 and 6, restarts publishing 7
    (holding the checkpoint's weights). Versions 5 and 6 are of weights it threw away; a group of
    version 4 is as old as one of version 7, a group of version 3 one version older."""
    resumed = (4, 7)
    assert [drop_reason(7, v, 1, resumed) for v in (5, 6)] == ["discarded", "discarded"]
    assert [age(7, v, resumed) for v in (4, 3, 7)] == [0, 1, 0]
    assert drop_reason(7, 3, 1, resumed) is None and drop_reason(7, 2, 1, resumed) == "stale"
    assert drop_reason(8, 3, 1, resumed) == "stale" and drop_reason(8, 7, 1, resumed) is None
    assert drop_reason(7, 8, 1, resumed) == "future"
    # without the lineage (the bug): version 6 would look one version old to a trainer at 7
    assert drop_reason(7, 6, 1) is None
