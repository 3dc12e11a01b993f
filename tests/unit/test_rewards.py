"""Rule-based GSM8K rewards and the reward registry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import get_args

import pytest

from tandem.config import ConfigError, RewardSpec, RewardType
from tandem.data.gsm8k import extract_gold
from tandem.rewards.gsm8k import answer_reward, format_partial_reward, format_reward, parse_number
from tandem.rewards.registry import _BUILTINS, RewardSet, load_function
from tandem.types import Example

GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("1,234", 1234.0),
        ("$1,234.50", 1234.5),
        ("3.50", 3.5),
        ("-7", -7.0),
        ("-$7", -7.0),
        ("18 dollars", 18.0),
        ("$18.00", 18.0),
        ("18 eggs", 18.0),
        ("18.", 18.0),
        ("The answer is 18", 18.0),
        ("5 + 13 = 18", 18.0),
        ("10-5", 5.0),  # a minus after a digit is subtraction, not a sign
        (".5", 0.5),
        ("50%", 50.0),
        ("", None),
        ("eighteen", None),
    ],
)
def test_parse_number(text: str, expected: float | None) -> None:
    assert parse_number(text) == expected


# (response, gold, answer reward, format reward)
CASES = [
    ("<think>6*3=18</think><answer>18</answer>", "18", 1.0, 1.25),
    ("<think>\nJanet has 16 eggs.\n</think>\n<answer> 18 </answer>\n", "18", 1.0, 1.25),
    ("  <think>x</think>   <answer>$18.00</answer>  ", "18", 1.0, 1.25),
    ("<think>x</think><answer>18 dollars</answer>", "18", 1.0, 1.25),
    ("<think>x</think><answer>1,200</answer>", "1200", 1.0, 1.25),
    ("<think>x</think><answer>$1,200</answer>", "1200", 1.0, 1.25),
    ("<think>x</think><answer>3.50</answer>", "3.5", 1.0, 1.25),
    ("<think>x</think><answer>-4</answer>", "-4", 1.0, 1.25),
    ("<think>x</think><answer>4</answer>", "-4", -1.0, 1.25),
    ("<think>x</think><answer>The answer is 18.</answer>", "18", 1.0, 1.25),
    ("<think>x</think><answer>5 + 13 = 18</answer>", "18", 1.0, 1.25),
    ("<think>x</think><answer>17</answer>", "18", -1.0, 1.25),
    ("<think></think><answer>18</answer>", "18", 1.0, 1.25),  # an empty think block is allowed
    ("<think>x</think><answer></answer>", "18", -1.0, -1.0),  # an empty answer is not
    ("<think>x</think><answer>  </answer>", "18", -1.0, -1.0),
    ("18", "18", -1.0, -1.0),  # no tags at all
    ("<answer>18</answer>", "18", 1.0, -1.0),  # no think block
    ("<think>x</think>18", "18", -1.0, -1.0),  # no answer block
    ("<think>x</think><answer>18", "18", -1.0, -1.0),  # cut off before </answer>
    ("Sure! <think>x</think><answer>18</answer>", "18", 1.0, -1.0),  # text before
    ("<think>x</think><answer>18</answer> Hope that helps.", "18", 1.0, -1.0),  # text after
    ("<think>x</think> so <answer>18</answer>", "18", 1.0, -1.0),  # text between
    ("<think>a<think>b</think></think><answer>18</answer>", "18", 1.0, -1.0),  # nested think
    ("<think>x</think><answer>18</answer><answer>19</answer>", "18", 1.0, -1.0),  # first answer counts
    ("<think>x</think><answer>19</answer><answer>18</answer>", "18", -1.0, -1.0),
    ("<think>x</think><answer>1<answer>18</answer></answer>", "18", 1.0, -1.0),  # nested answer
    ("<answer>18</answer><think>x</think>", "18", 1.0, -1.0),  # wrong order
    ("<THINK>x</THINK><ANSWER>18</ANSWER>", "18", -1.0, -1.0),  # tags are case-sensitive
]


@pytest.mark.parametrize(("response", "gold", "answer", "fmt"), CASES)
def test_reward_table(response: str, gold: str, answer: float, fmt: float) -> None:
    assert answer_reward(response, gold) == answer
    assert format_reward(response) == fmt


def test_answer_tolerance_is_relative() -> None:
    assert answer_reward("<answer>1000000.0000001</answer>", "1000000") == 1.0
    assert answer_reward("<answer>0.0000001</answer>", "0") == 1.0
    assert answer_reward("<answer>18.01</answer>", "18") == -1.0


def test_gold_that_is_not_a_number_fails_loudly() -> None:
    with pytest.raises(ValueError, match="not a number"):
        answer_reward("<answer>18</answer>", "eighteen")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>x</think><answer>18</answer>", 1.25),  # exact format
        ("ok <think>x</think><answer>18</answer>", 1.0),  # four tags in order, stray text
        ("<think>x</think> 18", 0.0),  # two tags
        ("<think>x 18", -0.5),  # one tag
        ("18", -1.0),  # none
        ("<answer>18</answer><think>x</think>", 0.0),  # only one pair in order
        ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),  # answer tags twice: not counted
    ],
)
def test_format_partial(response: str, expected: float) -> None:
    value = format_partial_reward(response)
    assert value == expected
    assert -1.0 <= value <= 1.25


def _real_rows(num: int) -> list[dict]:
    if not GSM8K_TRAIN.exists():
        pytest.skip(f"{GSM8K_TRAIN} not present")
    with GSM8K_TRAIN.open() as f:
        return [json.loads(next(f)) for _ in range(num)]


def test_real_gsm8k_golds_score_plus_one() -> None:
    for row in _real_rows(50):
        gold = extract_gold(row["answer"])
        value = int(gold)
        for written in (
            gold,
            f"{value:,}",
            f"${value:,}",
            f"${value}.00",
            f"{value} units",
            f"It is {value}.",
        ):
            response = f"<think>x</think><answer>{written}</answer>"
            assert answer_reward(response, gold) == 1.0, (written, gold)
            assert format_reward(response) == 1.25
        assert answer_reward(f"<think>x</think><answer>{value + 1}</answer>", gold) == -1.0


# --- registry ---------------------------------------------------------------------------------


def spec(type: str, weight: float = 1.0, function: str | None = None, name: str | None = None) -> RewardSpec:
    return RewardSpec(type, weight=weight, function=function, name=name)


EXAMPLE = Example(prompt_id="p-0", question="What is 9 + 9?", answer="18")

USER_MODULE = """
def brevity(response, example):
    return -0.01 * len(response)

def mentions_question(response, example):
    return 1.0 if example.question[:4] in response else 0.0

def returns_text(response, example):
    return "good"

def returns_nan(response, example):
    return float("nan")

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_reward_set_builtins_weighted_sum() -> None:
    rewards = RewardSet.from_specs([spec("answer"), spec("format", weight=0.5)])
    assert rewards.names == ["answer", "format"]
    total, info = rewards.score("<think>9+9</think><answer>18</answer>", EXAMPLE)
    assert info == {"answer": 1.0, "format": 1.25}
    assert total == 1.0 * 1.0 + 0.5 * 1.25
    total, info = rewards.score("18", EXAMPLE)
    assert (total, info) == (-1.5, {"answer": -1.0, "format": -1.0})


def test_reward_set_user_function(user_module: str) -> None:
    rewards = RewardSet.from_specs(
        [
            spec("answer"),
            spec("function", weight=2.0, function=f"{user_module}:brevity"),
            spec("format_partial"),
        ]
    )
    assert rewards.names == ["answer", "brevity", "format_partial"]
    response = "<think>x</think><answer>18</answer>"
    total, info = rewards.score(response, EXAMPLE)
    assert info["brevity"] == pytest.approx(-0.01 * len(response))
    assert total == pytest.approx(1.0 + 2.0 * info["brevity"] + 1.25)
    named = RewardSet.from_specs([spec("function", function=f"{user_module}:mentions_question", name="echo")])
    assert named.score("What is it", EXAMPLE) == (1.0, {"echo": 1.0})


def test_load_function_errors(user_module: str) -> None:
    assert callable(load_function(f"{user_module}:brevity"))
    with pytest.raises(ValueError, match="package.module:function"):
        load_function("my_rewards.brevity")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        load_function(f"{user_module}:missing")
    with pytest.raises(ValueError, match="not a function"):
        load_function(f"{user_module}:NOT_A_FUNCTION")


@pytest.mark.parametrize("attr", ["returns_text", "returns_nan"])
def test_user_function_bad_result_names_it(user_module: str, attr: str) -> None:
    rewards = RewardSet.from_specs([spec("function", function=f"{user_module}:{attr}")])
    with pytest.raises(ValueError, match=f"my_rewards:{attr}.*finite number"):
        rewards.score("x", EXAMPLE)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "`rewards` is empty; add at least one"),
        ([spec("length")], r"`rewards\[0\].type` is 'length'; choose one of"),
        ([spec("function")], r"`rewards\[0\].function` is None; type function needs it"),
        ([spec("answer", function="m:f")], r"`rewards\[0\].function` is set .* set type: function"),
        ([spec("answer", weight=math.inf)], r"`rewards\[0\].weight` is inf; it must be a finite number"),
        ([spec("answer"), spec("answer")], r"`rewards\[1\].name`: two rewards are named 'answer'"),
    ],
)
def test_reward_set_spec_errors(specs: list, message: str) -> None:
    """The rules are config's (check_rewards): the same messages as a config file gets."""
    with pytest.raises(ConfigError, match=message):
        RewardSet.from_specs(specs)


def test_every_reward_type_has_a_builder() -> None:
    assert {*_BUILTINS, "function", "model"} == set(get_args(RewardType))
    assert "overlong" in _BUILTINS
