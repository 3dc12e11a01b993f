"""Rewards in TRL's calling convention: what a function receives, None, async, instances, factories
(`kwargs`), the old per-item form beside it, and errors that name the reward and the sample."""

from __future__ import annotations

import functools
import importlib
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from tandem.algorithms.grpo import group_advantages
from tandem.config import ConfigError, RewardSpec
from tandem.rewards.calling import RewardError, convention
from tandem.rewards.registry import RewardSet
from tandem.trainer.batching import flatten_groups
from tandem.trainer.rl_steps import summarize_groups
from tandem.types import Completion, Example, Group

MODULE = """
import asyncio

CALLS = []
ORDER = []
EVENTS = {}
FACTORY_CALLS = []


def record(prompts, completions, completion_ids, **columns):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns))
    return [float(len(ids)) for ids in completion_ids]


def has_solution(completions, solution, **kwargs):
    return [None if gold is None else 1.0 for gold in solution]


def never_applies(completions, **kwargs):
    return [None for _ in completions]


def brevity(response, example):
    return -0.01 * len(response)


class Scaled:
    def __init__(self, factor=1.0):
        self.factor = factor

    def __call__(self, completions, **kwargs):
        return [self.factor * len(c if isinstance(c, str) else c[0]["content"]) for c in completions]


def make_length_penalty(max_len, scale=1.0):
    FACTORY_CALLS.append((max_len, scale))

    def length_penalty(completion_ids, **kwargs):
        return [-scale * max(0, len(ids) - max_len) for ids in completion_ids]

    return length_penalty


def reset():
    CALLS.clear(); ORDER.clear(); FACTORY_CALLS.clear()
    EVENTS.update(first=asyncio.Event(), second=asyncio.Event())


async def first(completions, **kwargs):
    ORDER.append("first started")
    EVENTS["first"].set()
    await asyncio.wait_for(EVENTS["second"].wait(), timeout=5)  # only returns if `second` runs meanwhile
    ORDER.append("first done")
    return [1.0 for _ in completions]


class Second:
    async def __call__(self, completions, **kwargs):
        ORDER.append("second started")
        EVENTS["second"].set()
        await asyncio.wait_for(EVENTS["first"].wait(), timeout=5)
        ORDER.append("second done")
        return [2.0 for _ in completions]


SECOND = Second()


async def old_async(response, example):
    await asyncio.sleep(0)
    return 0.5


def boom(completions, **kwargs):
    return [1.0 / 0 for _ in completions]


def old_boom(response, example):
    if "bad" in response:
        raise KeyError("no such key")
    return 1.0


async def judge_down(completions, **kwargs):
    raise ConnectionError("judge unreachable")


def too_few(completions, **kwargs):
    return [1.0]


def text_value(completions, **kwargs):
    return [1.0, "good"]


def inf_value(completions, **kwargs):
    return [1.0, float("inf")]


def scalar(completions, **kwargs):
    return 1.0


def needs_difficulty(completions, difficulty, **kwargs):
    return [1.0 for _ in completions]


def needs_state(completions, trainer_state, **kwargs):
    return [1.0 for _ in completions]


def make_nothing():
    return 3


def make_broken(level):
    raise ValueError("level must be positive")
"""


@pytest.fixture
def mod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "calling_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("calling_rewards")
    module.reset()
    yield module
    sys.modules.pop("calling_rewards", None)


def fn(attr: str, **fields) -> RewardSpec:
    return RewardSpec("function", function=f"calling_rewards:{attr}", **fields)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 9 + 9?"}]
CHAT_ROW = Example("p-chat", "What is 9 + 9?", "18", prompt=CHAT, columns={"solution": "18", "level": 2})
TEXT_ROW = Example("p-text", "2 + 2 =", "4", prompt="2 + 2 =", columns={"solution": "4"})
LEGACY_ROW = Example("p-old", "What is 1 + 1?", "2")


def score(rewards: RewardSet, rows: list[Example], texts: list[str], ids: list[list[int]] | None = None):
    ids = ids if ids is not None else [[7] * (i + 1) for i in range(len(texts))]
    return rewards.score_batch(texts, rows, ids)


# --- what a function receives


def test_one_call_per_batch_with_trls_arguments(mod) -> None:
    rewards = RewardSet.from_specs([fn("record")])
    rows = [CHAT_ROW, CHAT_ROW, TEXT_ROW, TEXT_ROW, LEGACY_ROW]
    texts = ["<think>a</think>18", "19", " 4", " 5", "2"]
    ids = [[1, 2], [3], [4, 5, 6], [], [8]]
    scored = rewards.score_batch(texts, rows, ids)

    assert len(mod.CALLS) == 1  # once for the batch, not once per completion
    call = mod.CALLS[0]
    # a chat prompt gives its messages and one assistant message per completion; a text prompt gives
    # the strings; a row without its own prompt is its question as one user turn (Rollout passes the
    # rendered messages: tested in test_reward_prompts_in_a_rollout)
    assert call["prompts"] == [
        CHAT,
        CHAT,
        "2 + 2 =",
        "2 + 2 =",
        [{"role": "user", "content": "What is 1 + 1?"}],
    ]
    assert call["completions"] == [
        [{"role": "assistant", "content": "<think>a</think>18"}],
        [{"role": "assistant", "content": "19"}],
        " 4",
        " 5",
        [{"role": "assistant", "content": "2"}],
    ]
    assert call["completion_ids"] == ids
    # every other column, one value per completion; a row without a column gives None there
    assert call["columns"] == {"solution": ["18", "18", "4", "4", None], "level": [2, 2, None, None, None]}
    assert [info for _, info in scored] == [{"record": float(len(i))} for i in ids]


def test_a_column_named_like_an_argument_is_refused(mod) -> None:
    row = Example("p-1", "q", "1", columns={"completions": "x"})
    with pytest.raises(ValueError, match="column named 'completions'.*rename"):
        score(RewardSet.from_specs([fn("record")]), [row], ["a"])


# --- None


def test_none_is_left_out_of_the_sum_and_an_all_none_sample_is_unscored(mod, caplog) -> None:
    rewards = RewardSet.from_specs(
        [fn("has_solution", weight=2.0), fn("never_applies"), RewardSpec("format", weight=0.5)]
    )
    caplog.set_level(logging.WARNING)
    (with_gold, without_gold) = score(rewards, [CHAT_ROW, LEGACY_ROW], ["x", "y"])
    # 2 * 1.0 + (never_applies left out) + 0.5 * -1.0
    assert with_gold == (1.5, {"has_solution": 1.0, "never_applies": None, "format": -1.0})
    assert without_gold == (-0.5, {"has_solution": None, "never_applies": None, "format": -1.0})

    alone = RewardSet.from_specs([fn("never_applies"), fn("has_solution")])
    nothing_applies = Example("p-none", "q", "", columns={"solution": None})
    total, info = alone.score("z", nothing_applies)
    assert (total, info) == (0.0, {"never_applies": None, "has_solution": None})  # TRL's nansum: 0
    assert not _completion(total, info).scored and _completion(1.5, with_gold[1]).scored
    assert "every reward returned None for 1 of 1 completions" in caplog.text and "'p-none'" in caplog.text
    caplog.clear()
    alone.score("z", nothing_applies)
    assert "every reward returned None" not in caplog.text  # said once


def test_builtin_answer_reads_the_solution_column_else_the_answer() -> None:
    rewards = RewardSet.from_specs([RewardSpec("answer")])
    row_with_column = Example("p-1", "q", "999", columns={"solution": "18"})
    no_gold = Example("p-2", "q", "")
    scored = score(rewards, [row_with_column, LEGACY_ROW, no_gold], ["<answer>18</answer>"] * 2 + ["x"])
    assert [info["answer"] for _, info in scored] == [1.0, -1.0, None]  # 18 vs 18, 18 vs 2, no gold


def _completion(reward: float, info: dict, advantage: float = 0.0) -> Completion:
    return Completion("t", [1, 2], True, reward, info, torch.zeros(2), None, advantage)


def test_advantages_leave_unscored_completions_out() -> None:
    nan = math.nan
    rewards = torch.tensor([1.0, 3.0, nan, 2.0, nan, nan, 5.0, 5.0])
    # group 1: scored 1, 3, 2: mean 2, std sqrt(((-1)^2 + 1^2 + 0^2) / 2) = 1 -> -1, 1, 0, 0 (unscored)
    # group 2: only 5, 5 scored: flat -> 0 everywhere
    got = group_advantages(rewards, 4, scale="group", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    got = group_advantages(rewards, 4, scale="none")
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    # batch: scored 1, 3, 2, 5, 5: mean 3.2, unbiased std sqrt((4.84 + 0.04 + 1.44 + 3.24 * 2) / 4) = sqrt(3.2)
    got = group_advantages(rewards, 4, scale="batch", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) / math.sqrt(3.2))
    # one scored member in a group: advantage 0, not NaN
    torch.testing.assert_close(group_advantages(torch.tensor([nan, 4.0]), 2), torch.zeros(2))
    # no NaN: the usual path, unchanged
    plain = torch.tensor([1.0, 3.0, 2.0, 4.0])
    torch.testing.assert_close(
        group_advantages(plain, 2), torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (2**0.5 + 1e-4)
    )


def _group(*completions: Completion) -> Group:
    return Group("g", "p", "prefix", [1], list(completions), policy_version=0)


def test_metrics_and_batches_skip_none() -> None:
    groups = [
        _group(
            _completion(2.0, {"answer": 1.0, "judge": None}, advantage=1.0),
            _completion(0.0, {"answer": None, "judge": None}),  # unscored
            _completion(-1.0, {"answer": -1.0, "judge": 0.5}, advantage=-1.0),
        ),
        _group(
            _completion(0.0, {"answer": None, "judge": None}),
            _completion(4.0, {"answer": None, "judge": 4.0}),
            _completion(0.0, {"answer": None, "judge": None}),
        ),
    ]
    stats = summarize_groups(groups)
    assert stats["reward_mean"] == pytest.approx((2.0 - 1.0 + 4.0) / 3)  # over the 3 scored
    assert stats["reward_answer"] == 0.0 and stats["answer_accuracy"] == 0.5  # over the 2 where it applies
    assert stats["reward_judge"] == pytest.approx(2.25)
    assert stats["completions_unscored"] == 3
    assert stats["zero_variance_groups"] == 1  # the second group has one scored reward
    none = summarize_groups([_group(_completion(0.0, {"judge": None}))])
    assert none["reward_mean"] is None and none["reward_judge"] is None and none["reward_std"] is None

    samples = flatten_groups(groups, scale_rewards="batch", adv_eps=0.0, skip_zero_variance=True)
    assert len(samples) == 3  # the flat second group is skipped
    # centred on the group's scored mean 0.5: 1.5, -, -1.5; scaled by the std of the scored 2, -1, 4:
    # mean 5/3, squares 1/9 + 64/9 + 49/9 = 114/9, over n - 1 = 2: 57/9
    assert [s.advantage for s in samples] == pytest.approx(
        [1.5 / math.sqrt(57 / 9), 0.0, -1.5 / math.sqrt(57 / 9)]
    )


# --- async, instances, factories


def test_async_rewards_are_awaited_together(mod) -> None:
    rewards = RewardSet.from_specs([fn("first"), fn("SECOND", name="second"), fn("old_async"), fn("brevity")])
    (total, info), _ = score(rewards, [LEGACY_ROW, LEGACY_ROW], ["ab", "cd"])
    # each waits for the other to start: run one after the other, the first would time out
    assert mod.ORDER[:2] == ["first started", "second started"] or mod.ORDER[:2] == [
        "second started",
        "first started",
    ]
    assert info == {"first": 1.0, "second": 2.0, "old_async": 0.5, "brevity": pytest.approx(-0.02)}
    assert total == pytest.approx(3.5 - 0.02)
    mod.reset()
    score(rewards, [LEGACY_ROW], ["again"])  # the same loop serves the next batch
    assert len(mod.ORDER) == 4


def test_instances_and_factories(mod) -> None:
    rewards = RewardSet.from_specs(
        [
            fn("Scaled", kwargs={"factor": 2.0}),  # a class built with kwargs: an instance with __call__
            fn("make_length_penalty", kwargs={"max_len": 2, "scale": 0.5}),
            fn("Scaled", kwargs={}, name="scaled_once"),  # kwargs: {} calls it with none
        ]
    )
    assert rewards.names == ["Scaled", "make_length_penalty", "scaled_once"]  # the factory's name
    assert mod.FACTORY_CALLS == [(2, 0.5)]  # built once, not per batch
    (_, info), (_, info2) = score(rewards, [TEXT_ROW, TEXT_ROW], ["abc", "a"], [[1, 2, 3, 4], [1]])
    assert info == {"Scaled": 6.0, "make_length_penalty": -1.0, "scaled_once": 3.0}
    assert info2 == {"Scaled": 2.0, "make_length_penalty": 0.0, "scaled_once": 1.0}
    assert mod.FACTORY_CALLS == [(2, 0.5)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (fn("Scaled"), r"`rewards\[0\].function`: calling_rewards:Scaled is a class; add `kwargs:`"),
        (fn("make_nothing", kwargs={}), r"`rewards\[0\].kwargs`: .* returned a int, not a reward function"),
        (
            fn("make_broken", kwargs={"level": 0}),
            r"`rewards\[0\].kwargs`: .*raised ValueError: level must be",
        ),
        (fn("make_broken", kwargs={"lvl": 0}), r"raised TypeError: .*unexpected keyword argument 'lvl'"),
        (fn("needs_state"), r"parameter 'trainer_state' has no default, and tandem does not pass"),
        (RewardSpec("answer", kwargs={"x": 1}), r"`rewards\[0\].kwargs` is set but .* is 'answer'"),
        (fn("record", kwargs={"not a name": 1}), r"`rewards\[0\].kwargs` has keys"),
    ],
)
def test_factory_and_signature_errors_name_the_spec(mod, spec: RewardSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RewardSet.from_specs([spec])


# --- the old form beside TRL's


def _old(response, example):
    return 1.0


def _old_kwargs(response, example, **kwargs):
    return 1.0


def _old_default(response, example=None):
    return 1.0


def _trl(completions, **kwargs):
    return []


def _trl_named(prompts, completions, completion_ids):
    return []


def _trl_columns(solution, **kwargs):
    return []


def _anything(*args, **kwargs):
    return []


def _one_arg(text):
    return 1.0


class _Instance:
    def __call__(self, completions, **kwargs):
        return []


def _scaled(completions, scale, **kwargs):
    return []


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        (_old, "per_item"),
        (_old_kwargs, "per_item"),  # two required positional parameters: the old form
        (_old_default, "per_item"),
        (_trl, "batch"),
        (_trl_named, "batch"),
        (_trl_columns, "batch"),  # **kwargs and one required positional parameter
        (_anything, "batch"),
        (_Instance(), "batch"),
        (functools.partial(_scaled, scale=2.0), "batch"),
        (max, "batch"),  # no readable signature: TRL's form
    ],
)
def test_the_convention_is_read_from_the_signature(function, expected: str) -> None:
    assert convention(function, "x") == expected


def test_a_signature_that_fits_neither_form_is_refused() -> None:
    with pytest.raises(ValueError, match="fits neither way"):
        convention(_one_arg, "m:f")


def test_old_per_item_functions_still_work(mod) -> None:
    rewards = RewardSet.from_specs([fn("brevity"), RewardSpec("format")])
    assert score(rewards, [LEGACY_ROW, CHAT_ROW], ["abcd", "<think>x</think><answer>1</answer>"]) == [
        (pytest.approx(-0.04 - 1.0), {"brevity": pytest.approx(-0.04), "format": -1.0}),
        (pytest.approx(-0.34 + 1.25), {"brevity": pytest.approx(-0.34), "format": 1.25}),
    ]


# --- errors name the reward and the sample


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        (
            "boom",
            r"'boom' \(calling_rewards:boom\) raised ZeroDivisionError: float division by zero at .*calling_rewards.py:\d+",
        ),
        ("judge_down", r"'judge_down' .* raised ConnectionError: judge unreachable"),
        (
            "too_few",
            r"'too_few' .* returned 1 values for 2 completions on a batch of 2 .*'p-old', completion 'first",
        ),
        (
            "text_value",
            r"returned 'good' \(a str\) for prompt 'p-chat', completion 'second'; each value must be a finite",
        ),
        ("inf_value", r"returned inf \(a float\) for prompt 'p-chat'"),
        ("scalar", r"returned a float on a batch of 2 .*it must return a list of 2 values"),
        (
            "needs_difficulty",
            r"cannot be called with this batch .*'difficulty'.*columns \['level', 'solution'\]",
        ),
    ],
)
def test_reward_errors_name_the_reward_and_the_sample(mod, attr: str, message: str) -> None:
    rewards = RewardSet.from_specs([fn(attr)])
    with pytest.raises(RewardError, match=message):
        score(rewards, [LEGACY_ROW, CHAT_ROW], ["first " + "x" * 100, "second"])


def test_an_old_form_error_names_its_own_sample(mod) -> None:
    rewards = RewardSet.from_specs([fn("old_boom")])
    with pytest.raises(
        RewardError, match=r"raised KeyError: 'no such key' .* on prompt 'p-chat', completion 'a bad one'"
    ):
        score(rewards, [LEGACY_ROW, CHAT_ROW], ["fine", "a bad one"])


def test_a_sampler_stopped_by_a_reward_error_is_not_started_again(tmp_path: Path, capsys) -> None:
    """`tandem sample` exits with RewardError.exit_code on one (cli.cmd_sample); the launcher then stops
    the run and shows the sampler's log, where a restart would only meet the same error."""
    from tandem.launch import Child, Launcher

    message = "tandem sample: error: reward 'boom' (my_rewards:boom) raised ZeroDivisionError"
    sampler = f"import sys; print({message!r}); sys.exit({RewardError.exit_code})"
    trainer = Child("trainer", [sys.executable, "-c", "import time; time.sleep(60)"])
    child = Child("sampler s0", [sys.executable, "-c", sampler], log_path=tmp_path / "s0.log")
    launcher = Launcher([trainer, child], sampler_restarts=5)
    launcher.start()
    assert launcher.wait() == RewardError.exit_code
    assert child.restarts == 0 and trainer.proc.poll() is not None
    err = capsys.readouterr().err
    assert "sampler s0 exited with code 4; stopping the other processes" in err and message in err
