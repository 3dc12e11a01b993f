"""The pure parts of the distributed trainer: strategy choice, the DeepSpeed JSON, the rank split,
the tensor form of a share, and the launch command lines."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from tandem.config import ConfigError, TrainingConfig, load_config, validate_batch
from tandem.distributed import deepspeed_config as dsc
from tandem.distributed.env import DistEnv, scatter_tensor_dicts
from tandem.launch import Nodes, plan
from tandem.trainer.batching import (
    Sample,
    collate,
    loss_normalizer,
    samples_from_tensors,
    samples_to_tensors,
    split_across_ranks,
)


@pytest.mark.parametrize(
    ("num_parameters", "expected"),
    [
        (135e6, ("ddp", 2)),
        (0.99e9, ("ddp", 2)),
        (1.5e9, ("deepspeed", 2)),
        (7e9, ("deepspeed", 2)),
        (14e9, ("deepspeed", 3)),
    ],
)
def test_auto_follows_the_seed_rule(num_parameters, expected):
    assert dsc.strategy_for(int(num_parameters), "auto", 2) == expected
    assert dsc.strategy_for(int(num_parameters), "deepspeed", 1) == ("deepspeed", 1)


def test_generated_deepspeed_config_follows_the_yaml():
    tc = TrainingConfig(
        distributed_strategy="deepspeed",
        zero_stage=3,
        micro_batch_size=2,
        gradient_accumulation_steps=4,
        max_grad_norm=0.5,
        mixed_precision="bf16",
        offload_optimizer="cpu",
        offload_param="cpu",
    )
    cfg = dsc.resolve(tc, world_size=4)
    assert cfg["train_batch_size"] == 2 * 4 * 4 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_clipping"] == 0.5 and not cfg["fp16"]["enabled"]
    # bf16 as DDP computes it: fp32 parameters under torch.autocast, gradients reduced in fp32
    assert cfg["bf16"] == {"enabled": False}
    assert cfg["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    zero = cfg["zero_optimization"]
    assert (
        zero["stage"] == 3
        and zero["offload_optimizer"]["device"] == "cpu"
        and zero["offload_param"]["device"] == "cpu"
    )


def test_a_deepspeed_json_that_chooses_bf16_keeps_deepspeeds_mode(tmp_path):
    """bf16 "auto" (or absent) follows the YAML the DDP way; a file that says bf16.enabled: true
    gets DeepSpeed's own bf16 mode, as written."""
    tc = TrainingConfig(distributed_strategy="deepspeed", mixed_precision="bf16")
    for bf16, autocast in (({"enabled": "auto"}, True), (None, True), ({"enabled": True}, False)):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}} | ({"bf16": bf16} if bf16 else {})))
        cfg = dsc.resolve(dataclasses.replace(tc, deepspeed_config=str(path)), world_size=2)
        assert cfg["bf16"]["enabled"] is not autocast
        assert cfg.get("torch_autocast", {}).get("enabled", False) is autocast
    # a file with its own torch_autocast section and bf16 "auto": its autocast, not both at once
    path.write_text(json.dumps({"bf16": {"enabled": "auto"}, "torch_autocast": {"enabled": True}}))
    own = dsc.resolve(dataclasses.replace(tc, deepspeed_config=str(path)), world_size=2)
    assert own["bf16"]["enabled"] is False and own["torch_autocast"] == {"enabled": True}
    # training.deepspeed_bf16=native: DeepSpeed's bf16 parameters (half the memory below ZeRO-3)
    native = dsc.resolve(dataclasses.replace(tc, deepspeed_bf16="native"), world_size=2)
    assert native["bf16"] == {"enabled": True} and "torch_autocast" not in native


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_json_files_fill_auto_from_the_yaml(stage):
    tc = TrainingConfig(
        distributed_strategy="deepspeed",
        deepspeed_config=f"configs/deepspeed/zero{stage}.json",
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        offload_optimizer="cpu",
    )
    cfg = dsc.resolve(tc, world_size=2)
    assert '"auto"' not in json.dumps(cfg)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["zero_optimization"]["stage"] == stage  # the file's own stage
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_a_json_that_disagrees_with_the_yaml_names_both(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}))
    tc = TrainingConfig(distributed_strategy="deepspeed", deepspeed_config=str(path), micro_batch_size=4)
    with pytest.raises(ConfigError) as err:
        dsc.resolve(tc, world_size=1)
    msg = str(err.value)
    assert (
        "train_micro_batch_size_per_gpu=16" in msg and "training.micro_batch_size" in msg and '"auto"' in msg
    )
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        dsc.resolve(tc, world_size=1)


def test_deepspeed_keys_without_deepspeed_are_refused():
    with pytest.raises(ConfigError, match="training.zero_stage.*distributed_strategy=deepspeed"):
        load_config(None, ["training.zero_stage=3", "training.distributed_strategy=ddp"])
    with pytest.raises(ConfigError, match="offload_param.*zero_stage=3"):
        load_config(None, ["training.distributed_strategy=deepspeed", "training.offload_param=cpu"])
    with pytest.raises(ConfigError, match="nvme_path"):
        load_config(None, ["training.distributed_strategy=deepspeed", "training.offload_optimizer=nvme"])
    with pytest.raises(ConfigError, match="choose one of: none, ddp, deepspeed, auto"):
        load_config(None, ["training.distributed_strategy=fsdp"])


def test_global_batch_counts_the_ranks():
    cfg = load_config(
        None, ["grpo.prompts_per_step=4", "sampling.num_generations=4", "training.micro_batch_size=4"]
    )
    cfg.training.gradient_accumulation_steps = 2
    validate_batch(cfg, 2)  # 4 x 2 x 2 = 16 = 4 prompts x 4
    with pytest.raises(ConfigError) as err:
        validate_batch(cfg, 4)  # 4 x 2 x 4 = 32 does not divide 16
    assert "x 4 ranks" in str(err.value) and "gradient_accumulation_steps to one of [1]" in str(err.value)


def _samples(lengths: list[list[int]]) -> list[Sample]:
    """Groups with the given completion lengths (prompt of 3 tokens each)."""
    out = []
    for g, group in enumerate(lengths):
        for n in group:
            out.append(Sample([g, g, g], list(range(n)), -torch.arange(n).float(), None, 0.5 * n, g, g))
    return out


def test_split_keeps_groups_whole_and_balances_tokens():
    samples = _samples([[10, 10], [2, 2], [9, 9], [3, 3]])  # group tokens: 23, 7, 21, 9
    shares = split_across_ranks(samples, 2)
    assert sum(len(share) for share in shares) == len(samples)
    for share in shares:
        groups = {s.group_index for s in share}
        assert all(sum(x.group_index == g for x in share) == 2 for g in groups)  # whole groups
    loads = sorted(
        sum(len(s.completion_ids) for s in share) + 3 * len({s.group_index for s in share})
        for share in shares
    )
    assert loads == [30, 30]  # 23 + 7 and 21 + 9: longest first onto the lighter rank
    assert split_across_ranks(samples, 1) == [samples]
    assert split_across_ranks(_samples([[4, 4]]), 3)[1:] == [[], []]  # fewer groups than ranks


def test_share_tensors_round_trip():
    samples = _samples([[1, 5], [3, 0]])
    samples[0].ref_logprobs = None
    back = samples_from_tensors(samples_to_tensors(samples))
    assert [(s.prompt_ids, s.completion_ids, s.advantage, s.policy_version, s.group_index) for s in back] == [
        (s.prompt_ids, s.completion_ids, s.advantage, s.policy_version, s.group_index) for s in samples
    ]
    assert all(torch.equal(a.sampler_logprobs, b.sampler_logprobs) for a, b in zip(back, samples))
    assert all(s.ref_logprobs is None for s in back)
    with_ref = _samples([[2]])
    with_ref[0].ref_logprobs = torch.tensor([-1.0, -2.0])
    assert torch.equal(
        samples_from_tensors(samples_to_tensors(with_ref))[0].ref_logprobs, torch.tensor([-1.0, -2.0])
    )
    assert samples_from_tensors(samples_to_tensors([])) == []
    t = samples_to_tensors(samples)
    assert scatter_tensor_dicts(DistEnv(), [t]) is t
    samples[1].masked = True
    assert [s.masked for s in samples_from_tensors(samples_to_tensors(samples))] == [
        False,
        True,
        False,
        False,
    ]


def test_masked_samples_leave_the_loss_mask_and_the_normalisers():
    """grpo.mask_truncated_completions: a masked sample keeps its tokens (completion_mask) but none
    of them reach the loss (loss_mask), and neither its tokens nor the sequence count in the loss's
    normaliser."""
    samples = _samples([[3, 2], [4, 1]])
    assert (
        loss_normalizer(samples, "token-mean") == 10 and loss_normalizer(samples, "seq-mean-token-mean") == 4
    )
    mb = collate(samples)
    assert mb.loss_mask is mb.completion_mask  # nothing masked: the very same mask
    samples[0].masked = samples[2].masked = True
    assert loss_normalizer(samples, "token-mean") == 3  # 2 + 1
    assert (
        loss_normalizer(samples, "seq-mean-token-mean")
        == loss_normalizer(samples, "seq-mean-token-sum-norm")
        == 2
    )
    mb = collate(samples)
    assert mb.completion_mask.sum(dim=1).tolist() == [3, 2, 4, 1]
    assert mb.loss_mask.sum(dim=1).tolist() == [0, 2, 0, 1]


def test_launch_builds_torchrun_and_deepspeed_command_lines():
    cfg = load_config(None, [])
    children = plan(
        None,
        [],
        cfg,
        ["0"],
        ["1", "2", "3"],
        Nodes(nnodes=2, node_rank=0, master_addr="10.0.0.1"),
        environ={},  # no inherited CUDA_VISIBLE_DEVICES: the indices are physical
    )
    trainer = children[0]
    assert trainer.cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert (
        "--nproc-per-node=3" in trainer.cmd
        and "--nnodes=2" in trainer.cmd
        and "--master-addr=10.0.0.1" in trainer.cmd
    )
    assert (
        trainer.env["CUDA_VISIBLE_DEVICES"] == "1,2,3" and "training.distributed_strategy=auto" in trainer.cmd
    )
    assert children[1].env["CUDA_VISIBLE_DEVICES"] == "0"

    ds = plan(None, [], cfg, ["cpu"], ["cpu", "cpu"], Nodes(launcher="deepspeed"))[0]
    assert ds.cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"] and "--num_gpus=2" in ds.cmd
    assert "training.device=cpu" in ds.cmd

    node1 = plan(None, [], cfg, [], ["0", "1"], Nodes(nnodes=2, node_rank=1), environ={})
    assert [c.name for c in node1] == ["trainer"]
    with pytest.raises(ConfigError, match="node 0 must run the samplers"):
        plan(None, [], cfg, [], ["0"], Nodes())
    with pytest.raises(ConfigError, match="not both"):
        plan(None, [], cfg, ["cpu"], ["cpu", "0"], Nodes())


def test_the_ddp_options_reach_distributed_data_parallel():
    """training.ddp_* (HF's names; the seeds' find_unused_parameters reads as the first) are the
    options of the DistributedDataParallel the engine builds (a gloo group of one, in a child)."""
    code = """
import torch
from tandem.config import load_config
from tandem.distributed.engine import TorchEngine
from tandem.distributed.env import init_distributed, shutdown

cfg = load_config(None, ["training.distributed_strategy=ddp", "training.find_unused_parameters=true",
                         "training.ddp_bucket_cap_mb=5", "training.ddp_broadcast_buffers=false"])
env = init_distributed("ddp", "cpu")
engine = TorchEngine(torch.nn.Linear(4, 4), cfg.training, env, torch.device("cpu"))
ddp = engine.model
print(ddp.find_unused_parameters, ddp.bucket_bytes_cap, ddp.broadcast_buffers)
shutdown(env)
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["True", str(5 * 1024 * 1024), "False"]


def test_a_cuda_group_maps_cpu_tensors_to_gloo():
    """nccl moves only CUDA tensors; the loops' collectives move small CPU tensors (broadcast_json,
    scatter_tensor_dicts), so a CUDA group is device-mapped. gloo alone stays gloo on any device."""
    from tandem.distributed.env import process_group_backend

    assert process_group_backend("nccl", "cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo", "cuda") == "gloo"
    assert process_group_backend("gloo", "cpu") == "gloo"


def test_zero3_ranks_gather_only_for_the_steps_that_publish():
    """Every rank can tell which optimizer steps publish weights (decoupled, every sync_every), so
    ZeRO-3 gathers the full parameters on those steps only; colocated runs never publish."""
    from tandem.transport.pacing import publishes_at

    assert [s for s in range(1, 10) if publishes_at(s, 3)] == [3, 6, 9]
    assert not any(publishes_at(s, 1, decoupled=False) for s in range(1, 5))


def test_an_fp16_loss_scale_survives_a_resume(tiny_model, tmp_path):
    """fp16's GradScaler state is checkpointed: a resumed run keeps the scale it found instead of
    starting again at 2**16 (and skipping steps to find it)."""
    import copy

    from tandem.distributed.engine import TorchEngine

    tc = TrainingConfig(mixed_precision="fp16", max_steps=4)
    engine = TorchEngine(copy.deepcopy(tiny_model), tc, DistEnv(), torch.device("cpu"))
    engine.scaler.scale(torch.ones(()))  # the scale lives once a loss was scaled
    engine.scaler.update(1024.0)  # as after overflows
    engine.save(tmp_path)
    resumed = TorchEngine(copy.deepcopy(tiny_model), tc, DistEnv(), torch.device("cpu"))
    assert resumed.scaler.get_scale() != 1024.0
    resumed.load(tmp_path)
    assert resumed.scaler.get_scale() == 1024.0


def test_lora_on_the_output_projection_or_a_head_bias_is_refused(tiny_model):
    """tandem scores tokens with the output projection's weight directly (fused log-prob head): an
    adapter there would never train and a bias would be dropped, so both are refused by name."""
    import copy

    pytest.importorskip("peft")
    from tandem.config import LoraSpec
    from tandem.models.loading import check_supported
    from tandem.models.lora import apply_lora

    with pytest.raises(ConfigError, match=r"target_modules` includes the output projection \(lm_head\)"):
        apply_lora(copy.deepcopy(tiny_model), LoraSpec(enabled=True, target_modules=["q_proj", "lm_head"]))
    biased = copy.deepcopy(tiny_model)
    head = biased.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    with pytest.raises(NotImplementedError, match="output projection has a bias"):
        check_supported(biased)
