"""Every shipped YAML loads and validates (keys, types, batch arithmetic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config import load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.experiment_name == path.stem


def test_the_seed_reproduction_matches_the_seed():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "grpo_gsm8k_qwen2.5_1.5b.yaml")
    assert (cfg.model.policy, cfg.model.reference) == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-3B-Instruct",
    )
    assert cfg.training.max_steps == 200 and cfg.grpo.kl_coef == 0.04
    assert [r.type for r in cfg.rewards] == ["answer", "format"]
