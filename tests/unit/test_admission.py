"""Semantic validation at the trainer's boundary: each well-formed but harmful group of the hostile-peer
report passes `wire.decode_group` and is then rejected by `check_group` with its reason; a sound group
passes; no input makes the check raise."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tandem.transport.admission import REASONS, GroupLimits, check_group
from tandem.transport.wire import decode_group, encode_group
from tandem.types import Completion, Group

LIMITS = GroupLimits(vocab_size=1000, num_generations=3, max_new_tokens=16, max_positions=64)


def sound_group(**changes) -> Group:
    completions = [
        Completion(
            text=f"<answer> {i} </answer>",
            generated_token_ids=[10 + i, 11, 12],
            is_finished=True,
            reward=1.0 - i,
            reward_info={"answer": 1.0 - i, "format": 0.0},
            old_policy_log_probs=-torch.rand(3) - 0.1,
            ref_policy_log_probs=-torch.rand(3) - 0.1,
            advantage=0.5 - 0.5 * i,
        )
        for i in range(3)
    ]
    group = Group(
        group_id="g-1",
        prompt_id="p-1",
        prefix="What is 1 + 1?",
        prefix_token_ids=[1, 2, 3],
        completions=completions,
        policy_version=2,
        sampler_id="sampler-0",
        metadata={"answer": "2"},
    )
    return dataclasses.replace(group, **changes)


def through_the_wire(group: Group) -> Group:
    """What the trainer's socket hands over: encoded by a peer, accepted by the strict decoder. Our
    encoder refuses lone surrogates, a hostile peer writes them as JSON escapes: LONE below stands
    for one."""
    frames = [bytes(f) for f in encode_group(group)]
    frames[0] = frames[0].replace(LONE.encode(), b"\\ud800")
    return decode_group(frames)


LONE = "<lone surrogate>"


def with_completion(i: int, **changes) -> Group:
    group = sound_group()
    if "generated_token_ids" in changes:  # one log-prob per token, as the wire insists
        n = len(changes["generated_token_ids"])
        changes |= {"old_policy_log_probs": -torch.ones(n), "ref_policy_log_probs": -torch.ones(n)}
    group.completions[i] = dataclasses.replace(group.completions[i], **changes)
    return group


def test_a_sound_group_is_admitted():
    assert check_group(through_the_wire(sound_group()), LIMITS) is None
    # None in reward_info: that component does not apply to the sample
    group = with_completion(1, reward_info={"answer": None, "format": 0.0})
    assert check_group(through_the_wire(group), LIMITS) is None


HOSTILE = {
    # the hostile-peer report's single well-formed messages, each of which stopped a trainer
    "token id 2**31-1": (with_completion(1, generated_token_ids=[10, 2**31 - 1, 12]), "token_id"),
    "empty completions": (sound_group(completions=[]), "group_size"),
    "reward_info keys differ": (with_completion(2, reward_info={"answer": 0.0, "other": 1.0}), "reward_info"),
    "lone surrogate text": (with_completion(0, text=f"ok {LONE} then"), "text"),
    "advantage 1e300": (with_completion(0, advantage=1e300), "non_finite"),
    "sampler_id of 524,300 chars": (sound_group(sampler_id="s" * 524_300), "sampler_id"),
    # and the rest of the run's limits
    "G differs from num_generations": (sound_group(completions=sound_group().completions[:2]), "group_size"),
    "completion beyond max_new_tokens": (with_completion(0, generated_token_ids=[5] * 17), "length"),
    "prompt beyond the context": (sound_group(prefix_token_ids=[5] * 62), "length"),
    "reward overflows float32": (with_completion(1, reward=-1e39), "non_finite"),
    "reward_info value overflows float32": (
        with_completion(1, reward_info={"answer": 4e38, "format": 0.0}),
        "non_finite",
    ),
    "positive log-prob": (
        with_completion(0, old_policy_log_probs=torch.tensor([-0.1, 0.5, -0.2])),
        "logprob",
    ),
    "sampler_id with a newline": (sound_group(sampler_id="a\nb"), "sampler_id"),
    "surrogate in metadata": (sound_group(metadata={"answer": LONE}), "text"),
    "metadata of 100 kB": (sound_group(metadata={"answer": "x" * 100_000}), "size"),
    "a huge prefix text": (sound_group(prefix="y" * 10**6), "size"),
    "timings overflow float32": (sound_group(timings={"generate": 1e300}), "non_finite"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_each_hostile_group_is_rejected_with_its_reason(name):
    group, reason = HOSTILE[name]
    received = through_the_wire(group)  # the decoder accepts it: the harm is semantic
    rejected = check_group(received, LIMITS)
    assert rejected is not None and rejected[0] == reason, rejected
    assert reason in REASONS and len(rejected[1]) < 400  # a log line, not the payload


def test_random_mutations_never_raise():
    """Field-level fuzzing of a sound group: check_group returns a verdict for every one."""
    rng = random.Random(0)
    values = [
        None,
        -1,
        0,
        2**31 - 1,
        2**63,
        1e300,
        float("nan"),
        "",
        "\ud800",
        "x" * 5000,
        [],
        {},
        [1.5],
        {"a": 1},
    ]
    fields = [f.name for f in dataclasses.fields(Group)]
    completion_fields = [f.name for f in dataclasses.fields(Completion)]
    for _ in range(500):
        group = sound_group()
        if rng.random() < 0.5:
            group = dataclasses.replace(group, **{rng.choice(fields): rng.choice(values)})
        else:
            i = rng.randrange(3)
            group.completions[i] = dataclasses.replace(
                group.completions[i], **{rng.choice(completion_fields): rng.choice(values)}
            )
        verdict = check_group(group, LIMITS)
        assert verdict is None or verdict[0] in REASONS


@pytest.mark.parametrize(
    ("bind_host", "curve", "warns"),
    [
        ("*", {}, True),
        ("0.0.0.0", {}, True),
        ("10.1.2.3", {}, True),
        ("127.0.0.1", {}, False),
        ("localhost", {}, False),
        ("::1", {}, False),
        ("*", {"server_secret_key": "keys/trainer.key_secret"}, False),
    ],
)
def test_binding_beyond_loopback_without_keys_warns_with_the_fix(bind_host, curve, warns):
    from tandem.config import CurveConfig
    from tandem.transport.auth import open_to_strangers

    warning = open_to_strangers(bind_host, CurveConfig(**curve))
    assert (warning is not None) == warns
    if warns:
        assert "tandem keygen" in warning and "pipeline.curve" in warning and "pipeline.bind_host" in warning


def test_an_agent_runs_limit_is_its_episode_budget():
    """A multi-turn episode holds several turns and the tool results between them: the trainer of an
    agent run admits completions up to the episode budget, not sampling.max_new_tokens (the first
    decoupled agent run on a GPU dropped every group with a tool call for its length)."""
    from types import SimpleNamespace

    from tandem.config import load_config
    from tandem.trainer.experience import group_limits

    policy = SimpleNamespace(config=SimpleNamespace(vocab_size=1000, max_position_embeddings=4096))
    plain = group_limits(load_config(None, ["sampling.max_new_tokens=16"]), policy)
    assert (plain.max_new_tokens, plain.length_key) == (16, "sampling.max_new_tokens")
    agent = ["sampling.max_new_tokens=16", "agent.tools=['tiny_agent:add']", "agent.max_turns=3"]
    limits = group_limits(load_config(None, agent), policy)
    assert limits.max_new_tokens == 48  # max_new_tokens x max_turns
    limits = group_limits(load_config(None, [*agent, "agent.max_episode_tokens=40"]), policy)
    assert (limits.max_new_tokens, limits.length_key) == (40, "agent.max_episode_tokens")
    limits = dataclasses.replace(limits, num_generations=3)
    long = [10] * 40
    assert check_group(with_completion(0, generated_token_ids=long), limits) is None
    reason, message = check_group(with_completion(0, generated_token_ids=long + [10]), limits)
    assert reason == "length" and "41 tokens; agent.max_episode_tokens=40" in message
