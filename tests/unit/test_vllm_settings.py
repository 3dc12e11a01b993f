"""`sampling.backend: vllm` settings, without starting an engine: config rules, the CPU cores and
KV cache it is given, the launcher's word on them, and a missing vLLM."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tandem.config import ConfigError, VLLMSpec, load_config
from tandem.launch import plan
from tandem.sampler.vllm_engine import VLLMEngine, cpu_cores, kv_bytes_per_token, model_len


def test_auto_binds_the_last_cores_of_the_sampler_s_share():
    assert cpu_cores("auto", 1, [0, 1]) == "1"
    assert cpu_cores("auto", 2, [0, 1, 2, 3]) == "2,3"
    assert cpu_cores("auto", 0, [0, 1, 2, 3]) == "2,3"  # no count: half of them
    assert cpu_cores("auto", 1, [4, 6]) == "6"  # the cores this process may use, not 0..n
    assert cpu_cores("0-3", 1, [0, 1]) == "0-3" and cpu_cores("nobind", 1) == "nobind"


def test_kv_bytes_and_model_length():
    config = SimpleNamespace(
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        num_hidden_layers=30,
        max_position_embeddings=8192,
    )
    # SmolLM2-135M: 2 (k, v) x 30 layers x 3 heads x 64 x 4 bytes
    assert kv_bytes_per_token(config, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert model_len(VLLMSpec(), 128, config) == 1152
    assert model_len(VLLMSpec(), 4096, config) == 5120
    assert model_len(VLLMSpec(max_model_len=700), 128, config) == 700
    config.max_position_embeddings = 1000
    assert model_len(VLLMSpec(), 128, config) == 1000


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sampling.vllm.cpu_threads_bind=cores", "sampling.vllm.cpu_threads_bind"),
        ("sampling.vllm.gpu_memory_utilization=0", "sampling.vllm.gpu_memory_utilization"),
        ("sampling.vllm.tensor_parallel_size=0", "sampling.vllm.tensor_parallel_size"),
        ("sampling.backend=sglang", "sampling.backend"),
    ],
)
def test_bad_vllm_settings_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/grpo_tiny.yaml", [override])


def test_vllm_needs_the_decoupled_pipeline():
    with pytest.raises(ConfigError, match="pipeline.mode=decoupled"):
        load_config("configs/grpo_tiny.yaml", ["sampling.backend=vllm", "pipeline.mode=colocated"])
    cfg = load_config(
        "configs/grpo_tiny.yaml", ["sampling.backend=vllm", "sampling.vllm.cpu_threads_bind=0-1"]
    )
    assert cfg.sampling.vllm.cpu_threads_bind == "0-1" and cfg.sampling.vllm.enforce_eager is None


def test_the_launcher_says_which_cores_vllm_takes(tmp_path):
    overrides = ["sampling.backend=vllm", f"output_dir={tmp_path}"]
    cfg = load_config("configs/grpo_tiny.yaml", overrides)
    children = plan("configs/grpo_tiny.yaml", overrides, cfg, ["cpu"], ["cpu"], environ={})
    sampler = children[1]
    assert "vLLM's threads bound to cores" in sampler.note and sampler.note in sampler.where
    assert not children[0].note  # the trainer's threads are not pinned
    plain = load_config("configs/grpo_tiny.yaml", [f"output_dir={tmp_path}"])
    assert not plan("configs/grpo_tiny.yaml", [], plain, ["cpu"], ["cpu"], environ={})[1].note


def test_a_missing_vllm_is_a_config_error_that_says_how_to_install_it(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine's VLLM_* settings stay here
    with pytest.raises(ConfigError, match=r"pip install -e \.\[vllm\]"):
        VLLMEngine(
            str(tiny_model_dir),
            spec=VLLMSpec(),
            dtype="float32",
            device=torch.device("cpu"),
            seed=0,
            max_new_tokens=8,
            batch_size=4,
        )
