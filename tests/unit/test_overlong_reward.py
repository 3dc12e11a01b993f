"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): hand values at the boundaries, the
`overlong` reward type built from a spec, and its config errors."""

from __future__ import annotations

import pytest

from tandem.config import ConfigError, RewardSpec, load_config
from tandem.rewards.length import soft_overlong_penalty
from tandem.rewards.registry import RewardSet
from tandem.types import Example


def test_soft_overlong_penalty_at_the_boundaries():
    # L_max 10, L_cache 4: free up to 10 - 4 = 6 tokens, then (6 - |y|) / 4, then -1 past 10
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 50]
    assert soft_overlong_penalty(lengths, max_length=10, cache=4) == [
        0.0,
        0.0,
        0.0,  # |y| = L_max - L_cache: still free
        -0.25,  # (6 - 7) / 4
        -0.5,
        -0.75,
        -1.0,  # |y| = L_max: (6 - 10) / 4, the linear part's end
        -1.0,  # past L_max
        -1.0,
    ]
    # cache = max_length: the fall starts at 0 tokens; cache 1: only |y| = L_max pays, -1
    assert soft_overlong_penalty([0, 1, 4], max_length=4, cache=4) == [0.0, -0.25, -1.0]
    assert soft_overlong_penalty([3, 4, 5], max_length=4, cache=1) == [0.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache"):
        soft_overlong_penalty([1], max_length=4, cache=5)


def test_overlong_reward_type_scores_generated_tokens():
    example = Example("p0", "What is 9 + 9?", "18")
    rewards = RewardSet.from_specs(
        [RewardSpec("answer"), RewardSpec("overlong", weight=0.5, kwargs={"cache": 2})], max_new_tokens=4
    )
    assert rewards.names == ["answer", "overlong"]
    # 3 generated tokens of L_max 4 (sampling.max_new_tokens), L_cache 2: (2 - 3) / 2 = -0.5
    total, info = rewards.score("<answer>18</answer>", example, [5, 6, 7])
    assert info == {"answer": 1.0, "overlong": -0.5}
    assert total == 1.0 + 0.5 * -0.5
    own = RewardSet.from_specs([RewardSpec("overlong", kwargs={"max_length": 8, "cache": 4})])
    assert own.score("x", example, [1] * 6) == (-0.5, {"overlong": -0.5})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ("{}", r"`rewards\[0\].kwargs.cache` is unset; type overlong needs the soft buffer length"),
        ("{cache: 0}", r"`rewards\[0\].kwargs.cache` is 0; it must be an integer in 1..max_length \(8\)"),
        ("{cache: 9}", r"`rewards\[0\].kwargs.cache` is 9; .* raise `rewards\[0\].kwargs.max_length`"),
        ("{cache: 2, max_length: 0}", r"`rewards\[0\].kwargs.max_length` is 0; it must be an integer >= 1"),
        ("{cache: 2.5}", r"`rewards\[0\].kwargs.cache` is 2.5"),
        ("{cache: 2, soft_punish_cache: 2}", r"`rewards\[0\].kwargs` has \['soft_punish_cache'\]"),
    ],
)
def test_overlong_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"rewards=[{{type: overlong, kwargs: {kwargs}}}]", "sampling.max_new_tokens=8"])


def test_overlong_config_defaults_to_max_new_tokens():
    cfg = load_config(None, ["rewards=[{type: answer}, {type: overlong, kwargs: {cache: 8}}]"])
    assert cfg.rewards[1].resolved_name == "overlong" and cfg.sampling.max_new_tokens >= 8
    with pytest.raises(ConfigError, match=r"max_length \(4\)"):
        load_config(None, ["rewards=[{type: overlong, kwargs: {cache: 8}}]", "sampling.max_new_tokens=4"])
