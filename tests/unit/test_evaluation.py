"""Held-out evaluation figures (sampler/evaluation.py): mean@k, pass@k, reward means and what does not
apply, by hand; how a metrics row takes an evaluation of version 0 and a later one."""

from __future__ import annotations

import pytest
import torch

from tandem.sampler.evaluation import eval_fields, row_fields
from tandem.types import Completion, Group


def completion(answer: float | None, fmt: float, length: int = 3) -> Completion:
    info = {"answer": answer, "format": fmt}
    total = fmt + (answer or 0.0)
    return Completion("t", list(range(length)), True, total, info, torch.zeros(length), None)


def group(*completions: Completion) -> Group:
    return Group("g", "p", "q", [1], list(completions), 0)


def test_mean_and_pass_at_k_by_hand():
    groups = [
        group(completion(1.0, 1.0), completion(-1.0, 1.0)),  # one of two right: passes
        group(completion(-1.0, -1.0, 5), completion(-1.0, 1.0, 5)),  # none right
        group(completion(None, 1.0), completion(None, -1.0)),  # no gold: the answer reward does not apply
    ]
    fields = eval_fields(groups, "answer", num_samples=2)
    assert fields["eval_accuracy"] == pytest.approx(1 / 4)  # 1 right of the 4 judged completions
    assert fields["eval_pass_at_k"] == pytest.approx(1 / 2)  # 1 of the 2 judged prompts
    assert fields["eval_reward_answer"] == pytest.approx((1 - 1 - 1 - 1) / 4)
    assert fields["eval_reward_format"] == pytest.approx((1 + 1 - 1 + 1 + 1 - 1) / 6)
    assert fields["eval_completion_length"] == pytest.approx((3 + 3 + 5 + 5 + 3 + 3) / 6)
    assert (fields["eval_num_examples"], fields["eval_num_samples"]) == (3, 2)
    assert eval_fields(groups[2:], "answer", 2)["eval_accuracy"] is None  # nothing judged: null


def test_a_row_takes_version_0_as_initial_and_the_newest_other():
    first, later = (
        {"eval_accuracy": 0.1, "eval_policy_version": 0},
        {"eval_accuracy": 0.4, "eval_policy_version": 4},
    )
    assert row_fields([(0, first), (4, later)]) == {
        "eval_accuracy_initial": 0.1,
        "eval_policy_version_initial": 0,
        "eval_accuracy": 0.4,
        "eval_policy_version": 4,
    }
    assert row_fields([]) == {}
