"""Fixtures of the multi-process tests."""

from __future__ import annotations

import pytest


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
