"""Dynamic sampling (sampler/dynamic.py): which groups are kept, the cap per share of a batch,
what each kept group reports of the dropped ones, and what a trainer row makes of it."""

from __future__ import annotations

import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.sampler.dynamic import GroupFilter, filtered_fields, informative, max_extra_prompts
from tandem.transport.wire import WireError, decode_group, encode_group
from tandem.types import Completion, Group


def group(name: str, rewards: list[float | None], tokens: int = 3) -> Group:
    completions = [
        Completion(
            text="x",
            generated_token_ids=[5] * tokens,
            is_finished=True,
            reward=0.0 if r is None else r,
            reward_info={"answer": r},
            old_policy_log_probs=torch.zeros(tokens),
            ref_policy_log_probs=None,
        )
        for r in rewards
    ]
    return Group(name, name, "q", [1, 2], completions, 0, "s0")


def test_a_group_is_informative_when_its_scored_rewards_differ():
    assert informative(group("a", [0.0, 1.0]))
    assert not informative(group("b", [1.0, 1.0]))
    # unscored completions (every reward None) are out of the baseline: one scored reward is flat
    assert not informative(group("c", [1.0, None]))
    assert informative(group("d", [1.0, None, 0.0]))


def test_flat_groups_are_dropped_and_reported_on_the_next_kept_group():
    f = GroupFilter(share=2, max_extra=10)
    kept = f.admit([group("a", [1, 1], tokens=4), group("b", [0, 0], tokens=2), group("c", [0, 1])])
    assert [g.group_id for g in kept] == ["c"]
    assert kept[0].filtered == {"groups": 2, "tokens": 2 * 4 + 2 * 2}
    kept = f.admit([group("d", [0, 1])])
    assert kept[0].filtered == {}  # nothing dropped since "c"
    assert (f.generated_total, f.filtered_total) == (4, 2)


def test_the_cap_is_per_share_of_a_batch_and_then_groups_pass_as_they_come():
    f = GroupFilter(share=2, max_extra=1)
    kept = f.admit([group("a", [1, 1]), group("b", [1, 1]), group("c", [0, 1])])
    assert [g.group_id for g in kept] == ["b", "c"]  # a dropped (the cap), b kept although flat
    assert kept[0].filtered == {"groups": 1, "tokens": 6}
    # the share (2 groups) is complete: the next share has its own cap again
    kept = f.admit([group("d", [1, 1]), group("e", [0, 1])])
    assert [g.group_id for g in kept] == ["e"]


def test_the_filter_resumes_from_its_state():
    f = GroupFilter(share=3, max_extra=2)
    f.admit([group("a", [1, 1]), group("b", [0, 1])])
    g = GroupFilter(share=3, max_extra=2)
    g.load_state_dict(f.state_dict())
    assert g.state_dict() == f.state_dict()
    # one drop left in this share: the next flat group is dropped, the one after it kept
    kept = g.admit([group("c", [1, 1]), group("d", [1, 1])])
    assert [x.group_id for x in kept] == ["d"] and kept[0].filtered == {"groups": 1, "tokens": 6}


def test_a_trainer_row_counts_the_dropped_groups_and_their_extra_generation():
    kept = [group("a", [0, 1], tokens=5), group("b", [0, 1], tokens=5)]
    kept[1].filtered = {"groups": 3, "tokens": 10}
    assert filtered_fields(kept) == {"groups_filtered": 3, "groups_generated": 5, "generation_overhead": 0.5}
    assert filtered_fields([])["generation_overhead"] == 0.0


def test_the_cap_defaults_to_three_per_prompt_of_a_batch_split_between_samplers():
    cfg = load_config(None, ["grpo.prompts_per_step=8", "grpo.dynamic_sampling=true"])
    assert max_extra_prompts(cfg) == 24 and max_extra_prompts(cfg, 5) == 5
    cfg = load_config(None, ["grpo.dynamic_sampling_max_extra_prompts=5"])
    assert max_extra_prompts(cfg) == 5 and max_extra_prompts(cfg, 2) == 3


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling_max_extra_prompts"):
        load_config(None, ["grpo.dynamic_sampling_max_extra_prompts=0"])
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling. is True but .tandem ppo."):
        load_config(None, ["method=ppo", "grpo.dynamic_sampling=true"])


def test_the_counts_travel_with_the_group_and_bad_ones_are_refused():
    g = group("a", [0, 1])
    assert "filtered" not in encode_group(g)[0].decode()  # without dynamic sampling: as before
    g.filtered = {"groups": 2, "tokens": 17}
    assert decode_group(encode_group(g)).filtered == {"groups": 2, "tokens": 17}
    for bad in ({"groups": -1}, {"groups": 1.5}, {"groups": True}, {"seconds": 3}, {"tokens": 2**41}):
        frames = encode_group(group("b", [0, 1]))
        header = frames[0].decode().replace('"completions":', f'"filtered":{_json(bad)},"completions":', 1)
        with pytest.raises(WireError, match="filtered"):
            decode_group([header.encode(), *frames[1:]])


def _json(value) -> str:
    import json

    return json.dumps(value)
