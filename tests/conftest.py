"""Shared fixtures: a tiny random causal LM with a real byte-level BPE tokenizer, built in code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.sampler.vllm_engine import vllm_available
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
    runs them on a machine with a GPU). `vllm`-marked tests need vLLM: skipped where it is not
    installed, unless TANDEM_REQUIRE_VLLM=1 (`make test` where `make setup` installed it)."""
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(
            reason="needs a CUDA device (make gpu-check runs these on a GPU machine)"
        )
    if os.environ.get("TANDEM_REQUIRE_VLLM") != "1" and not vllm_available():
        skips["vllm"] = pytest.mark.skip(reason="needs vLLM (make setup-vllm; or pip install -e .[vllm])")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
