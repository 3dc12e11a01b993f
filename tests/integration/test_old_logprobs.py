"""pi_old from the sampler or from the trainer (grpo.old_logprobs), the truncated importance weight,
and the rows comparing the sampler's log-probs with the trainer's, on colocated tiny-model runs
whose sampler log-probs are made off, as another generation engine's would be (more so)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_grpo_loop import tiny_config

from tandem.trainer.experience import LocalExperience
from tandem.trainer.grpo import train_grpo

NOISE = 0.3  # the sampler's log-probs are off by N(0, NOISE) per token


@pytest.fixture
def taken(monkeypatch):
    """Every batch the loop takes, with a copy of the weights it was taken with. The sampler's
    log-probs get seeded noise, and from the second batch on the first group is marked as made by
    the previous version (max_staleness 1 admits it), which leaves it out of the comparison."""
    batches = []
    original = LocalExperience.next_groups
    noise = torch.Generator().manual_seed(7)

    def next_groups(self, num_groups, keep_alive=None):
        groups, stats = original(self, num_groups, keep_alive)
        for c in (c for g in groups for c in g.completions):
            off = NOISE * torch.randn(c.old_policy_log_probs.shape, generator=noise)
            c.old_policy_log_probs = c.old_policy_log_probs + off
        if self.version > 0:
            groups[0].policy_version -= 1
        batches.append((groups, self.version, copy.deepcopy(self.policy).eval()))
        return groups, stats

    monkeypatch.setattr(LocalExperience, "next_groups", next_groups)
    return batches


def direct_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log p(completion token | prompt, earlier tokens), by a plain forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]


def expected_fields(groups, version: int, model, temperature: float, cap: float) -> dict:
    """The comparison fields (over groups made by `version`) and the importance weights (over every
    token), computed from scratch; `model` holds the weights the batch was taken with."""
    same, weights = [], []
    for g in groups:
        for c in g.completions:
            trainer = direct_logprobs(model, g.prefix_token_ids, c.generated_token_ids, temperature)
            r = (trainer - c.old_policy_log_probs).double()
            weights.append(torch.exp(r))
            if g.policy_version == version:
                same.append(r)
    r, w = torch.cat(same), torch.cat(weights)
    return {
        "sampler_logprob_diff": float(r.abs().mean()),
        "sampler_logprob_kl": float((torch.exp(r) - r - 1).mean()),
        "sampler_logprob_tokens": r.numel(),
        "importance_weight_mean": float(w.clamp(max=cap).mean()),
        "importance_weight_capped": float((w >= cap).double().mean()),
    }


def rows_of(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_fields(row: dict, want: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), (key, row[key], want[key])


COMPARISON = ("sampler_logprob_diff", "sampler_logprob_kl", "sampler_logprob_tokens")


def test_sampler_old_logprobs_are_compared_in_the_first_step_s_forward(tiny_model_dir, tmp_path, taken):
    """The default: pi_old is the sampler's, so the off log-probs show in the ratio of the very
    first update; the comparison comes from each batch's (only) step, over the groups made by the
    weights that take them; no importance fields."""
    cfg = tiny_config(tiny_model_dir, tmp_path, "sampler", "training.max_steps=3", "sampling.temperature=0.8")
    train_grpo(cfg)
    rows = rows_of(cfg)
    assert rows[0]["ratio_abs_dev"] > 0.1
    assert rows[0]["sampler_logprob_tokens"] == rows[0]["tokens_generated"]  # batch 1: all version 0
    for row, (groups, version, model) in zip(rows, taken, strict=True):
        assert_fields(row, expected_fields(groups, version, model, 0.8, 2.0), COMPARISON)
        assert "importance_weight_mean" not in row
    assert rows[1]["sampler_logprob_tokens"] < rows[1]["tokens_generated"]  # one group left out


def test_trainer_old_logprobs_make_the_first_update_on_policy(tiny_model_dir, tmp_path, taken):
    """grpo.old_logprobs=trainer: the same off log-probs, yet the first update of every batch has
    ratio 1; the recomputation compares the whole batch (the batch's first row), the second pass
    over a batch starts from updated weights and compares nothing (null, 0 tokens); the importance
    weights are min(pi_old / pi_sampler, cap) over every token of each step."""
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "trainer",
        "training.max_steps=4",
        "grpo.num_iterations=2",
        "grpo.old_logprobs=trainer",
        "grpo.importance_correction=true",
        "grpo.importance_cap=1.2",
    )
    train_grpo(cfg)
    rows = rows_of(cfg)
    assert [r["policy_version"] for r in rows] == [0, 0, 1, 1]  # batch 2: one group marked as of version 1
    for (first, second), (groups, version, model) in zip(zip(rows[::2], rows[1::2]), taken, strict=True):
        want = expected_fields(groups, version, model, 1.0, 1.2)
        assert first["ratio_abs_dev"] < 1e-6
        assert second["ratio_abs_dev"] > 1e-3  # pi_old stays the batch's; the weights moved
        assert_fields(first, want, COMPARISON)
        assert second["sampler_logprob_tokens"] == 0
        assert second["sampler_logprob_diff"] is None and second["sampler_logprob_kl"] is None
        for row in (first, second):
            assert 0 < row["importance_weight_capped"] < 1
            assert_fields(row, want, ("importance_weight_mean", "importance_weight_capped"))
    assert all(math.isfinite(r["loss"]) for r in rows)
