"""ZeRO-3 loads under deepspeed.zero.Init (`training.zero3_init`): each rank builds only its shard of
the model, and training from those shards gives what training from a whole load gives (and DDP).
Two ranks under torchrun on the CPU (gloo, DeepSpeed's CPU accelerator), the tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from integration.test_distributed import assert_same, run_driver, torchrun
from integration.test_rm import rm_args
from tandem.config import load_config
from tandem.distributed.deepspeed_config import zero3_init_config
from tandem.trainer.metrics import read_metrics

BATCH = ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]  # x 2 ranks = 16
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]"]
LOADED_SHARDED = "loaded under deepspeed.zero.Init"  # rank 0's log line for each sharded load


@pytest.fixture
def zero3(tmp_path) -> list[str]:
    """ZeRO-3 that keeps every parameter sharded between forwards: by default DeepSpeed keeps those
    under stage3_param_persistence_threshold (1e5 elements) whole on every rank, all of the tiny model's."""
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return [
        "training.distributed_strategy=deepspeed",
        "training.zero_stage=3",
        f"training.deepspeed_config={path}",
    ]


def final_weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


# ------------------------------------------------------------------ which runs load sharded (no ranks)


def training(*overrides: str):
    return load_config(None, list(overrides)).training


def never() -> int:
    raise AssertionError("only `auto` asks for the model's size")


def test_which_runs_load_under_zero_init(tmp_path):
    deepspeed = "training.distributed_strategy=deepspeed"
    for overrides in (
        ["training.distributed_strategy=ddp"],
        [deepspeed, "training.zero_stage=2"],
        [deepspeed, "training.zero_stage=3", "training.zero3_init=false"],
    ):
        assert zero3_init_config(training(*overrides), 2, "float32", never) is None, overrides
    config = zero3_init_config(training(deepspeed, "training.zero_stage=3"), 2, "float32", never)
    assert config["zero_optimization"]["stage"] == 3
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    # auto shards only above 7B parameters (ZeRO-3), sized from the config before any weight is read
    auto = training("training.distributed_strategy=auto")
    assert zero3_init_config(auto, 2, "float32", lambda: 3 * 10**9) is None
    assert zero3_init_config(auto, 2, "float32", lambda: 8 * 10**9)["zero_optimization"]["stage"] == 3
    # a DeepSpeed file's own stage decides, as it does for the engine
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert zero3_init_config(training(deepspeed, f"training.deepspeed_config={path}"), 2, "float32", never)


def test_shards_keep_the_model_dtype_without_mixed_precision():
    """zero.Init casts to the config's precision (fp32 when mixed precision is off): a bfloat16 model
    must stay bfloat16, as a whole load keeps it; with mixed precision, DeepSpeed's compute dtype,
    which the engine casts a whole load to anyway."""
    zero3 = ["training.distributed_strategy=deepspeed", "training.zero_stage=3"]
    bf16_model = zero3_init_config(training(*zero3), 2, "bfloat16", never)
    assert bf16_model["bf16"]["enabled"] and not bf16_model["fp16"]["enabled"]
    mixed = zero3_init_config(training(*zero3, "training.mixed_precision=fp16"), 2, "float32", never)
    assert mixed["fp16"]["enabled"] and not mixed["bf16"]["enabled"]


# ------------------------------------------------------------------ 2 ranks: shards at load, same training


@pytest.mark.slow
def test_each_rank_loads_its_shard_and_trains_as_a_whole_load_and_ddp(tiny_model_dir, tmp_path, zero3):
    """tests/dist_driver.py loads the policy as the trainers do (run.load_policy) and records what each
    rank holds right after loading: parameter storage plus ZeRO-3 shards."""
    pytest.importorskip("deepspeed")
    sharded, record = run_driver(tmp_path, tiny_model_dir, "sharded", 2, *zero3, *BATCH)
    whole, record_whole = run_driver(
        tmp_path, tiny_model_dir, "whole", 2, *zero3, "training.zero3_init=false", *BATCH
    )
    ddp, _ = run_driver(tmp_path, tiny_model_dir, "ddp", 2, "training.distributed_strategy=ddp", *BATCH)
    half = record["full_numel"] // 2  # every tiny parameter has an even number of elements
    assert record["shard_numel"] == half and record["held_at_load"] == [half, half]
    assert record_whole["held_at_load"] == [record["full_numel"]] * 2  # the path zero.Init replaces
    assert record["held_after_steps"] == [half, half]  # and training ran on shards
    for row, row_whole in zip(record["rows"], record_whole["rows"], strict=True):
        nulls = {k for k, v in row.items() if v is None}  # fields nothing applied to (e.g. a reward's mean)
        assert nulls == {k for k, v in row_whole.items() if v is None}
        numbers, numbers_whole = ({k: v for k, v in r.items() if k not in nulls} for r in (row, row_whole))
        assert numbers == pytest.approx(numbers_whole, rel=1e-12)  # grad_norm: seen 1 float64 ulp apart
    assert_same(sharded, whole, "zero.Init vs whole load")  # measured: bit for bit equal
    assert_same(sharded, ddp, "zero.Init vs ddp")


@pytest.mark.slow
def test_lora_and_checkpointed_activations_on_a_sharded_load(tiny_model_dir, tmp_path, zero3):
    """PEFT wraps the sharded base; its adapters are made whole after the load (a few thousand
    elements) and DeepSpeed shards them with the rest."""
    pytest.importorskip("peft")
    pytest.importorskip("deepspeed")
    lora = [*LORA, "training.gradient_checkpointing=true", *BATCH]
    sharded, record = run_driver(tmp_path, tiny_model_dir, "sharded", 2, *zero3, *lora)
    whole, _ = run_driver(tmp_path, tiny_model_dir, "whole", 2, *zero3, "training.zero3_init=false", *lora)
    adapters = {k: v for k, v in sharded.items() if ".lora_B" in k}
    assert adapters and all(v.abs().max() > 0 for v in adapters.values())  # B starts at 0: they trained
    shard, full = record["shard_numel"], record["full_numel"]
    assert all(shard < held < full for held in record["held_at_load"]), record["held_at_load"]
    assert record["held_after_steps"] == [shard, shard]
    assert_same(sharded, whole, "zero.Init vs whole load, LoRA + checkpointing")


@pytest.mark.slow
def test_ppo_value_head_beside_a_sharded_policy(tiny_model_dir, tmp_path, zero3):
    """PPO's value head is made whole after the sharded load; under ZeRO-3 it is sharded with the
    policy, and engine.gathered() must gather it too for checkpoints and exports (save_value_head
    refuses a shard). 2 sharded ranks end where one plain process ends (tests/ppo_dist_driver.py)."""
    pytest.importorskip("deepspeed")
    from integration.test_ppo import run_driver as run_ppo_driver

    one, _ = run_ppo_driver(
        tmp_path,
        tiny_model_dir,
        "one",
        1,
        "training.distributed_strategy=none",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=6",
    )
    two, _ = run_ppo_driver(
        tmp_path,
        tiny_model_dir,
        "two",
        2,
        *zero3,
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=3",
    )
    assert two["value_head.weight"].shape == one["value_head.weight"].shape == (1, 32)
    # the tolerance (and its measurement) of test_ppo.py's test_two_ranks_equal_one_rank
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=0, atol=5e-6, msg=name)


def dpo_args(model_dir, out_dir, name: str, *overrides: str) -> list[str]:
    return [
        "-m",
        "tandem.cli",
        "dpo",
        f"experiment_name={name}",
        f"output_dir={out_dir}",
        "seed=3",
        f"model.policy={model_dir}",
        "data.num_examples=8",
        "data.num_eval_examples=3",
        "dpo.beta=0.1",
        "dpo.reference_logps=online",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.learning_rate=1e-3",
        "training.max_steps=2",
        "training.num_epochs=100",
        "training.save_steps=0",
        "training.device=cpu",
        *overrides,
    ]


@pytest.mark.slow
def test_dpo_reference_on_the_trainer_ranks_is_sharded_too(tiny_model_dir, tmp_path, zero3):
    """dpo.reference_logps=online keeps a frozen reference beside the policy on every rank: it loads
    sharded as well and runs in a DeepSpeed engine without optimizer (engine.frozen_forward)."""
    pytest.importorskip("deepspeed")
    proc = torchrun(2, *dpo_args(tiny_model_dir, tmp_path, "sharded", *zero3))
    torchrun(2, *dpo_args(tiny_model_dir, tmp_path, "whole", *zero3, "training.zero3_init=false"))
    assert (proc.stdout + proc.stderr).count(LOADED_SHARDED) == 2  # the policy, then the reference
    rows, rows_whole = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("sharded", "whole"))
    # after one update the policy has moved away from the reference: the loss is no longer log 2
    assert rows[1]["reward_margin"] != 0 and rows[1]["loss"] < rows[0]["loss"]
    for row, row_whole in zip(rows, rows_whole, strict=True):
        assert row.keys() == row_whole.keys()
        for key in {"loss", "reward_margin", "grad_norm", "eval_loss"} & row.keys():
            assert row[key] == pytest.approx(row_whole[key], rel=1e-9), key
    assert_same(final_weights(tmp_path / "sharded"), final_weights(tmp_path / "whole"), "dpo")


@pytest.mark.slow
def test_a_sharded_reward_model_resumes_exactly_and_exports_whole(tiny_model_dir, tmp_path, zero3):
    """`tandem rm` (AutoModelForSequenceClassification: a new score head, initialised on rank 0 and
    handed out) under zero.Init: 4 steps straight equal 2 steps, a DeepSpeed checkpoint and 2 resumed
    steps; the export gathers the whole model into a folder from_pretrained loads."""
    pytest.importorskip("deepspeed")
    common = [*zero3, "training.gradient_accumulation_steps=1", "training.save_steps=2"]

    def rm(name: str, *overrides: str):
        return torchrun(
            2, "-m", "tandem.cli", "rm", *rm_args(tiny_model_dir, tmp_path, name, *common, *overrides)
        )

    proc = rm("straight", "training.max_steps=4")
    assert LOADED_SHARDED in proc.stdout + proc.stderr
    rm("resumed", "training.max_steps=2")
    assert (tmp_path / "resumed" / "checkpoints" / "step-2" / "deepspeed").is_dir()
    rm("resumed", "training.max_steps=4", "training.resume_from_checkpoint=latest")
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert_equal(straight, resumed, "resumed vs uninterrupted")
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    assert not torch.equal(resumed["model.norm.weight"], before["model.norm.weight"])

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "resumed" / "final")
    assert model.score.weight.shape == (1, model.config.hidden_size)
    torch.testing.assert_close(model.score.weight, resumed["score.weight"], rtol=0, atol=0)
