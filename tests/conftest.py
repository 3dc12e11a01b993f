"""Shared fixtures: a tiny random causal LM with a real byte-level BPE tokenizer, built in code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need CUDA: skipped with the reason where there is none (`make gpu-check`
    runs them on a machine with a GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
