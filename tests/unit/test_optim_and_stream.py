"""Learning-rate schedules by hand, weight-decay groups, and the resumable prompt stream."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.config import TrainingConfig
from tandem.data.gsm8k import load_examples
from tandem.data.stream import PromptStream
from tandem.distributed.optim import build_optimizer, lr_factor


def test_warmup_then_cosine_by_hand():
    cfg = TrainingConfig(max_steps=12, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    # warmup: (s + 1) / 2 -> 0.5, 1.0; then cosine over 10 steps from 1.0 down to the 0.1 floor
    assert [lr_factor(s, cfg) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, cfg) == pytest.approx(1.0)
    assert lr_factor(7, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # 0.55
    assert lr_factor(12, cfg) == pytest.approx(0.1)
    linear = TrainingConfig(max_steps=10, warmup_steps=0, lr_scheduler="linear")
    assert lr_factor(5, linear) == pytest.approx(0.5)
    assert lr_factor(3, TrainingConfig(lr_scheduler="constant")) == 1.0


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, TrainingConfig(weight_decay=0.1))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}


def test_prompt_stream_resumes_where_it_stopped():
    examples = load_examples("synthetic", "train", 7, seed=0)
    straight = PromptStream(examples, 3, seed=1)
    expected = [[e.prompt_id for e in straight.next_batch()] for _ in range(5)]  # crosses two epochs

    first = PromptStream(examples, 3, seed=1)
    got = [[e.prompt_id for e in first.next_batch()] for _ in range(2)]
    second = PromptStream(examples, 3, seed=1)
    second.load_state_dict(first.state_dict())
    got += [[e.prompt_id for e in second.next_batch()] for _ in range(3)]
    assert got == expected
    first_epoch = [pid for batch in expected for pid in batch][:7]
    assert sorted(first_epoch) == sorted(e.prompt_id for e in examples), "an epoch visits every example once"


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="data.dataset"):
        PromptStream([], 2, seed=0)


def test_a_module_can_give_some_parameters_their_own_learning_rate():
    """PPO's value head (ppo.value_learning_rate): its parameters get their own base rate, the rest
    keep training.learning_rate in the usual decay / no-decay groups, and warmup scales both."""
    from tandem.config import load_config
    from tandem.distributed.optim import build_optimizer, build_scheduler

    tc = load_config(
        None, ["training.learning_rate=1e-4", "training.weight_decay=0.1", "training.warmup_steps=2"]
    ).training
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 4), "value_head": torch.nn.Linear(4, 1)})
    model.learning_rates = {"value_head.": 1e-2}
    optimizer = build_optimizer(model, tc)
    groups = [(g["lr"], g["weight_decay"], [p.shape for p in g["params"]]) for g in optimizer.param_groups]
    assert groups == [
        (1e-4, 0.1, [torch.Size([4, 4])]),
        (1e-4, 0.0, [torch.Size([4])]),
        (1e-2, 0.1, [torch.Size([1, 4])]),
        (1e-2, 0.0, [torch.Size([1])]),
    ]
    scheduler = build_scheduler(optimizer, tc)
    assert scheduler.get_last_lr() == pytest.approx([5e-5, 5e-5, 5e-3, 5e-3])  # warmup step 1 of 2
