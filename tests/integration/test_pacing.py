"""Sampler pacing against the trainer's announced schedule, over a real data channel and real
status files: a sampler that makes all it is allowed never leaves the trainer short and never
makes a group that goes stale, however many versions a batch spans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

zmq = pytest.importorskip("zmq")

from tandem.config import load_config  # noqa: E402
from tandem.trainer.experience import RemoteExperience  # noqa: E402
from tandem.trainer.rl_steps import batch_steps  # noqa: E402
from tandem.transport.channel import GroupSender, free_tcp_port  # noqa: E402
from tandem.transport.pacing import groups_allowed  # noqa: E402
from tandem.transport.weights import FsWeightReader  # noqa: E402
from tandem.types import Completion, Group  # noqa: E402

PROMPTS = 2  # grpo.prompts_per_step; 2 completions each: 4 sequences per batch


def group(index: int, version: int) -> Group:
    completions = [
        Completion(
            text="7",
            generated_token_ids=[5, 6],
            is_finished=True,
            reward=float(i),
            reward_info={},
            old_policy_log_probs=torch.full((2,), -0.5),
            ref_policy_log_probs=torch.full((2,), -0.5),
            advantage=i - 0.5,
        )
        for i in range(2)
    ]
    return Group(f"g{index}", f"p{index}", "3 + 4?", [1, 2], completions, version, "s0")


# (grpo.num_iterations, micro_batch_size, sync_every, max_staleness): steps per batch 1, 2 and 4,
# one version per step or one per two steps, strictly on-policy or one version behind
SCHEDULES = [(1, 4, 1, 0), (1, 4, 1, 1), (2, 4, 1, 0), (2, 4, 1, 1), (1, 4, 2, 0), (1, 1, 2, 1), (2, 2, 1, 0)]


@pytest.mark.parametrize(("iterations", "micro_batch", "sync_every", "max_staleness"), SCHEDULES)
def test_a_sampler_at_its_quota_feeds_every_batch_fresh_and_makes_nothing_in_vain(
    tmp_path, iterations, micro_batch, sync_every, max_staleness
):
    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "experiment_name=pacing",
            f"grpo.prompts_per_step={PROMPTS}",
            "sampling.num_generations=2",
            f"grpo.num_iterations={iterations}",
            f"training.micro_batch_size={micro_batch}",
            "training.gradient_accumulation_steps=1",
            f"pipeline.sync_every={sync_every}",
            f"pipeline.max_staleness={max_staleness}",
            "pipeline.sync_method=fs",
            "pipeline.bind_host=127.0.0.1",
            f"pipeline.data_port={free_tcp_port()}",
            f"pipeline.sync_port={free_tcp_port()}",
        ],
    )
    cfg.run_dir.mkdir(parents=True)
    policy = torch.nn.Linear(2, 2)
    # what the trainer checks groups against (an HF model's config has these)
    policy.config = SimpleNamespace(vocab_size=16, max_position_embeddings=64)
    steps_per_batch = batch_steps(cfg.training, 2 * PROMPTS, iterations, 1)
    experience = RemoteExperience(cfg, cfg.run_dir, policy)
    sender = GroupSender(f"tcp://127.0.0.1:{cfg.pipeline.data_port}")
    reader = FsWeightReader(cfg.run_dir / "weights")
    made = taken = step = 0
    first_batch = None
    versions_taken = []

    def sample() -> None:  # the sampler makes all it may with the newest weights
        nonlocal made, first_batch
        status = reader.status()
        first_batch = status.batches if first_batch is None else first_batch
        allowed = groups_allowed(status, status.version, first_batch, PROMPTS, max_staleness)
        while made < allowed:
            sender.send(group(made, status.version))
            made += 1

    try:
        experience.expect(step, 0, steps_per_batch)
        sample()
        for _ in range(6):
            assert made - taken >= PROMPTS, "the trainer would wait for groups its sampler may not make"
            groups, stats = experience.next_groups(PROMPTS)
            taken += len(groups)
            assert stats["groups_dropped_stale"] == 0
            versions_taken.append(experience.version)
            # the trainer holds the weights of its newest version only at a step that published it
            assert experience.weights_version() == (experience.version if step % sync_every == 0 else None)
            assert all(experience.version - g.policy_version <= max_staleness for g in groups)
            experience.expect(step, steps_per_batch, steps_per_batch)
            sample()
            for _ in range(steps_per_batch):
                step += 1
                experience.on_step(policy, step)
                sample()
        # batch b is taken at step b x steps_per_batch, holding version step // sync_every
        take_version = [b * steps_per_batch // sync_every for b in range(64)]
        assert versions_taken == take_version[:6]
        # in flight: exactly the groups of the next batches that will still find them fresh
        fresh = sum(v <= experience.version + max_staleness for v in take_version[6:])
        assert made - taken == PROMPTS * fresh
    finally:
        sender.close()
        experience.close(finished=True)
