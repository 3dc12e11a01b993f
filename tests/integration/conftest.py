"""Fixtures of the multi-process tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_run(tmp_path, tiny_model_dir):
    """Run folders of tiny-model pipeline runs (tests/integration/test_pipeline.py's `Run`); every
    process they started is killed at the end of the test."""
    from integration.test_pipeline import Run

    runs = []

    def make(name: str, *overrides: str) -> Run:
        runs.append(Run(tmp_path, tiny_model_dir, name, *overrides))
        return runs[-1]

    yield make
    for run in runs:
        run.kill_all()


@pytest.fixture(scope="session")
def reward_model_dirs(tiny_model_dir, tmp_path_factory):
    """Two reward models (helpful, harmless) on the tiny LM, with different fixed score heads."""
    from tandem.models.loading import load_tokenizer
    from tandem.models.reward import load_reward_model

    dirs = []
    for name, seed in (("helpful", 1), ("harmless", 2)):
        model = load_reward_model(str(tiny_model_dir))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator) * 0.5)
        folder = tmp_path_factory.mktemp(f"rm-{name}")
        model.save_pretrained(folder)
        load_tokenizer(str(tiny_model_dir)).save_pretrained(folder)
        dirs.append(folder)
    return tuple(dirs)
