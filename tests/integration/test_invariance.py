"""Invariance classes of the update: how a batch is cut into micro-batches does not change it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

from tandem.config import RewardSpec, load_config
from tandem.data.gsm8k import load_examples
from tandem.data.preferences import encode_pair, make_preferences
from tandem.data.prompts import PromptStyle
from tandem.distributed.engine import TorchEngine
from tandem.distributed.env import DistEnv
from tandem.distributed.optim import build_scheduler
from tandem.models.loading import check_same_tokenizer
from tandem.models.reward import ScoreModule, load_reward_model
from tandem.rewards.registry import RewardSet
from tandem.sampler.rollout import Rollout
from tandem.trainer import rm
from tandem.trainer.batching import flatten_groups
from tandem.trainer.grpo import optimizer_step
from tandem.trainer.rl_steps import Share


def _groups(model, tokenizer):
    rollout = Rollout(
        policy=model,
        reference=model,
        tokenizer=tokenizer,
        rewards=RewardSet.from_specs([RewardSpec("function", function="tiny_rewards:digit_count")]),
        question_style=PromptStyle("", (), ""),
        row_style=PromptStyle(),
        num_generations=4,
        max_new_tokens=10,
        generator=torch.Generator().manual_seed(0),
    )
    return rollout.run(load_examples("synthetic", "train", 2, seed=0), policy_version=0)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_1_x_accumulation_8_equals_8_x_1(tiny_model, tiny_model_dir, loss_agg):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = _groups(tiny_model, tokenizer)
    samples = flatten_groups(groups, scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
    assert len(samples) == 8 and any(s.advantage != 0 for s in samples)

    results = []
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        cfg = load_config(
            None,
            [
                f"training.micro_batch_size={micro}",
                f"training.gradient_accumulation_steps={accum}",
                "grpo.prompts_per_step=2",
                f"grpo.loss_agg={loss_agg}",
                "sampling.max_new_tokens=10",
            ],
        )
        model = copy.deepcopy(tiny_model).train()
        # plain SGD with lr 1: the parameter change is the gradient itself (Adam's first step
        # would blow fp32 rounding of near-zero gradients up to +-lr)
        engine = TorchEngine(model, cfg.training, DistEnv(), torch.device("cpu"))
        engine.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.scheduler = build_scheduler(engine.optimizer, cfg.training)
        stats = optimizer_step(engine, Share.local(samples, cfg), cfg, torch.device("cpu"))
        results.append((stats, {k: v.detach().clone() for k, v in model.state_dict().items()}))

    (ref_stats, ref_params), others = results[0], results[1:]
    for stats, params in others:
        assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-7)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-7, msg=name)


def _sgd_update(tiny_model, samples, overrides):
    """The parameter change of one optimizer_step under plain SGD with lr 1 (the gradient itself)."""
    cfg = load_config(None, ["grpo.prompts_per_step=2", "sampling.max_new_tokens=10", *overrides])
    model = copy.deepcopy(tiny_model).train()
    engine = TorchEngine(model, cfg.training, DistEnv(), torch.device("cpu"))
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.scheduler = build_scheduler(engine.optimizer, cfg.training)
    stats = optimizer_step(engine, Share.local(samples, cfg), cfg, torch.device("cpu"))
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("loss_agg", "level"),
    [("seq-mean-token-mean", "token"), ("token-mean", "sequence"), ("seq-mean-token-sum-norm", "token")],
)
def test_masked_truncated_completions_update_as_if_they_were_absent(
    tiny_model, tiny_model_dir, loss_agg, level
):
    """grpo.mask_truncated_completions: with half the completions cut at max_new_tokens, the update is
    that of the batch without them (their loss terms and their share of the normaliser are gone),
    whatever the micro-batch cut; their rewards still shaped the others' advantages."""
    groups = _groups(tiny_model, AutoTokenizer.from_pretrained(tiny_model_dir))
    for k, c in enumerate(c for g in groups for c in g.completions):
        c.is_finished = k % 2 == 0
    samples = flatten_groups(
        groups, scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False, mask_truncated=True
    )
    kept = [s for s in samples if not s.masked]
    assert len(kept) == 4 and any(s.advantage != 0 for s in kept)
    options = [f"grpo.loss_agg={loss_agg}", f"grpo.importance_sampling_level={level}"]
    cut = ["training.gradient_accumulation_steps=1"]
    want_stats, want = _sgd_update(tiny_model, kept, [*options, *cut, "training.micro_batch_size=4"])
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        cut = [f"training.micro_batch_size={micro}", f"training.gradient_accumulation_steps={accum}"]
        stats, params = _sgd_update(tiny_model, samples, [*options, *cut])
        assert stats["loss"] == pytest.approx(want_stats["loss"], rel=1e-5, abs=1e-7)
        assert stats["entropy"] == pytest.approx(want_stats["entropy"], rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_cost_model_step_does_not_depend_on_the_micro_batch_cut(tiny_model_dir):
    """The harmless reward model with its classification term (weight 2): 8 pairs as micro-batch 8 x
    accumulation 1, 1 x 8 and 2 x 4 give one update. Labels are left out unevenly (pair i has both,
    only the chosen one or none), so the micro-batches' labelled shares differ from their pair shares."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = make_preferences("mixed", 8, seed=4)
    for i, pair in enumerate(pairs):
        pair.chosen_is_safe = pair.chosen_is_safe if i % 3 != 2 else None
        pair.rejected_is_safe = pair.rejected_is_safe if i % 3 == 0 else None
    batch = [encode_pair(tokenizer, p, 64) for p in pairs]
    assert rm.num_labels(batch) == 9
    base = load_reward_model(str(tiny_model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    base.config.pad_token_id = pad_id

    results = []
    for micro, accum in ((8, 1), (1, 8), (2, 4)):
        cfg = load_config(
            None,
            [f"training.micro_batch_size={micro}", f"training.gradient_accumulation_steps={accum}"],
            method="rm",
        )
        model = copy.deepcopy(base).train()
        engine = TorchEngine(model, cfg.training, DistEnv(), torch.device("cpu"), forward=ScoreModule(model))
        engine.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the change is the gradient
        engine.scheduler = build_scheduler(engine.optimizer, cfg.training)
        stats = rm.optimizer_step(
            engine,
            batch,
            cfg.training,
            torch.device("cpu"),
            DistEnv(),
            pad_id,
            classification_loss_weight=2.0,
        )
        results.append((stats, {k: v.detach().clone() for k, v in model.state_dict().items()}))

    (ref_stats, ref_params), others = results[0], results[1:]
    assert ref_stats["classification_loss"] > 0 and ref_stats["loss"] > 2 * ref_stats["classification_loss"]
    for stats, params in others:
        for key in ("loss", "classification_loss", "classification_accuracy", "accuracy"):
            assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-7), key
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-7, msg=name)


def test_reference_with_another_tokenizer_is_refused(tiny_model_dir):
    from tiny_models import make_tiny_tokenizer

    policy = AutoTokenizer.from_pretrained(tiny_model_dir)
    other = make_tiny_tokenizer()
    other.add_tokens(["<extra>"])
    check_same_tokenizer(policy, AutoTokenizer.from_pretrained(tiny_model_dir))
    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(policy, other)
