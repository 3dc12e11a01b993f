"""The seeds' and HF's key names are read as tandem's (or refused with the replacement); a config
of another method is refused; DeepSpeed "auto" is filled wherever HF's integration fills it;
mixed_precision auto picks by the device."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import yaml

from tandem.config import ConfigError, TrainingConfig, load_config
from tandem.distributed import deepspeed_config
from tandem.distributed.runtime import cpu_has_fast_bf16, resolve_mixed_precision


def _file(tmp_path, data, name="seed.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "seed, expected",
    [
        ({"per_device_train_batch_size": 2}, {"micro_batch_size": 2}),
        ({"num_train_epochs": 3}, {"num_epochs": 3}),
        ({"bf16": True}, {"mixed_precision": "bf16"}),
        ({"fp16": True, "bf16": False}, {"mixed_precision": "fp16"}),
        ({"bf16": False}, {"mixed_precision": "no"}),
        ({"lr_scheduler_type": "cosine"}, {"lr_scheduler": "cosine"}),
        ({"lr_scheduler_type": "constant_with_warmup"}, {"lr_scheduler": "constant"}),
        ({"lr_scheduler_type": "cosine_with_min_lr"}, {"lr_scheduler": "cosine"}),
        # HF: ceil(ratio x total steps); 0.05 x 30 = 1.5 -> 2
        ({"warmup_ratio": 0.05, "max_steps": 30}, {"warmup_steps": 2}),
        ({"adam_epsilon": 1e-6}, {"adam_eps": 1e-6}),
        ({"distributed_backend": "gloo"}, {"dist_backend": "gloo"}),
        ({"ddp_backend": "nccl"}, {"dist_backend": "nccl"}),
        ({"distributed_backend": "ddp"}, {"distributed_strategy": "ddp"}),
        ({"find_unused_parameters": True}, {"ddp_find_unused_parameters": True}),
        ({"ddp_find_unused_parameters": True}, {"ddp_find_unused_parameters": True}),
        ({"ddp_bucket_cap_mb": 50}, {"ddp_bucket_cap_mb": 50.0}),
        ({"ddp_broadcast_buffers": False}, {"ddp_broadcast_buffers": False}),
        ({"save_strategy": "no"}, {"save_steps": 0}),
        ({"save_strategy": "steps", "save_steps": 7}, {"save_steps": 7}),
        ({"deepspeed": "configs/deepspeed/zero2.json"}, {"deepspeed_config": "configs/deepspeed/zero2.json"}),
    ],
)
def test_a_seed_key_in_the_training_section_becomes_the_tandem_key(tmp_path, seed, expected, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.config"):
        cfg = load_config(_file(tmp_path, {"training": seed}))
    for key, value in expected.items():
        assert getattr(cfg.training, key) == value, key
    seed_only = [k for k in seed if not hasattr(TrainingConfig, k)]
    for key in seed_only:  # said once, as "X is read as Y"
        assert sum(f"training.{key}" in r.message and "is read as" in r.message for r in caplog.records) == 1


def test_the_seeds_deepspeed_section_and_top_level_keys(tmp_path):
    path = _file(
        tmp_path,
        {
            "run_name": "seedrun",
            "per_device_train_batch_size": 4,
            "gen_update_steps": 3,
            "deepspeed": {"config_path": "configs/deepspeed/zero3.json", "zero_stage": 3},
        },
    )
    cfg = load_config(path)
    assert cfg.experiment_name == "seedrun"
    assert cfg.training.micro_batch_size == 4
    assert cfg.pipeline.sync_every == 3
    assert (cfg.training.deepspeed_config, cfg.training.zero_stage) == ("configs/deepspeed/zero3.json", 3)
    assert cfg.training.distributed_strategy == "deepspeed"


def test_a_deepspeed_section_keeps_an_explicit_auto_strategy(tmp_path):
    path = _file(
        tmp_path,
        {"deepspeed": {"config_path": "x.json"}, "training": {"distributed_strategy": "auto"}},
    )
    assert load_config(path).training.distributed_strategy == "auto"


@pytest.mark.parametrize(
    "seed, fix",
    [
        ({"save_strategy": "epoch"}, "training.save_steps"),
        ({"eval_strategy": "epoch"}, "training.eval_steps"),
        ({"lr_scheduler_type": "polynomial"}, "training.lr_scheduler"),
        ({"distributed_backend": "mpi"}, "training.dist_backend"),
        ({"per_device_eval_batch_size": 4}, "training.micro_batch_size"),
        ({"gen_device": 1}, "--sampling-devices"),
        ({"warmup_ratio": 2}, "[0, 1]"),
        ({"deepspeed": {"config_path": "a.json", "offload": True}}, "training.offload_optimizer"),
    ],
)
def test_a_seed_key_tandem_cannot_mean_is_refused_with_the_replacement(tmp_path, seed, fix):
    with pytest.raises(ConfigError) as err:
        load_config(_file(tmp_path, {"training": seed}))
    assert fix in str(err.value) and next(iter(seed)) in str(err.value)


def test_the_safe_mm_dpo_origin_s_cost_model_weight_is_read_as_rm_s(tmp_path, caplog):
    """mmdpo-alignment's rm_config.yaml keeps `classification_loss_weight` at the top level."""
    assert load_config(None, method="rm").rm.classification_loss_weight == 1.0  # the origin's value
    with caplog.at_level(logging.INFO, logger="tandem.config"):
        cfg = load_config(_file(tmp_path, {"classification_loss_weight": 0.5}), method="rm")
    assert cfg.rm.classification_loss_weight == 0.5
    assert any("is read as `rm.classification_loss_weight: 0.5`" in r.message for r in caplog.records)
    assert (
        load_config(None, ["classification_loss_weight=2"], method="rm").rm.classification_loss_weight == 2.0
    )
    with pytest.raises(ConfigError, match="keep one"):
        load_config(
            _file(tmp_path, {"classification_loss_weight": 0.5, "rm": {"classification_loss_weight": 1.0}})
        )


def test_a_seed_key_that_disagrees_with_the_tandem_key_names_both(tmp_path):
    path = _file(tmp_path, {"training": {"per_device_train_batch_size": 2, "micro_batch_size": 8}})
    with pytest.raises(ConfigError, match="training.micro_batch_size: 8") as err:
        load_config(path)
    assert "per_device_train_batch_size" in str(err.value)
    with pytest.raises(ConfigError, match="keep one"):
        load_config(_file(tmp_path, {"training": {"bf16": True, "fp16": True}}, "both.yaml"))


def test_an_override_with_a_seed_name_wins_over_the_file(tmp_path):
    path = _file(tmp_path, {"training": {"micro_batch_size": 8, "max_steps": 40}})
    cfg = load_config(path, ["training.per_device_train_batch_size=2", "training.warmup_ratio=0.1"])
    assert cfg.training.micro_batch_size == 2
    assert cfg.training.warmup_steps == 4  # 0.1 x 40


def test_a_grpo_file_without_method_is_refused_by_the_other_commands():
    for method in ("sft", "rm", "dpo"):
        with pytest.raises(ConfigError, match="run it with `tandem grpo`"):
            load_config("configs/grpo_tiny.yaml", method=method)
    assert load_config("configs/grpo_tiny.yaml", method="grpo").method == "grpo"
    # PPO reads GRPO's sampling/rewards/pipeline sections: a GRPO file runs as PPO
    assert load_config("configs/grpo_tiny.yaml", method="ppo").method == "ppo"


def test_a_file_that_names_no_method_and_no_method_section_runs_anywhere(tmp_path):
    path = _file(tmp_path, {"model": {"policy": "embedded"}, "training": {"max_steps": 3}})
    for method in ("grpo", "sft", "rm", "dpo", "ppo"):
        assert load_config(path, method=method).method == method
    with pytest.raises(ConfigError, match="tandem sft"):
        load_config(_file(tmp_path, {"sft": {"packing": True}}, "s.yaml"), method="dpo")


def test_every_shipped_config_is_refused_by_every_other_method_command():
    shipped = {
        "configs/grpo_tiny.yaml": {"grpo", "ppo"},
        "configs/ppo_tiny.yaml": {"ppo"},
        "configs/sft_tiny.yaml": {"sft"},
        "configs/rm_helpful.yaml": {"rm"},
        "configs/rm_harmless.yaml": {"rm"},
        "configs/dpo_tiny.yaml": {"dpo"},
        "configs/safe_mm_dpo_tiny.yaml": {"dpo"},
        "configs/safe_mm_dpo_margin_tiny.yaml": {"dpo"},
        "configs/grpo_gsm8k_qwen2.5_1.5b.yaml": {"grpo", "ppo"},
    }
    for path, allowed in shipped.items():
        for method in ("grpo", "sft", "rm", "dpo", "ppo"):
            if method in allowed:
                load_config(path, method=method)
            else:
                with pytest.raises(ConfigError, match="tandem"):
                    load_config(path, method=method)


def _hf_style_zero3(tmp_path):
    """A zero3.json as HF users write it: "auto" wherever the Trainer fills a value."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(config))
    return path


def test_an_hf_style_zero3_json_has_every_auto_filled(tmp_path):
    tc = TrainingConfig(
        distributed_strategy="deepspeed",
        zero_stage=3,
        deepspeed_config=str(_hf_style_zero3(tmp_path)),
        micro_batch_size=2,
        gradient_accumulation_steps=3,
        learning_rate=3e-6,
        adam_beta1=0.8,
        adam_beta2=0.95,
        weight_decay=0.1,
        warmup_steps=5,
        max_steps=50,
        mixed_precision="bf16",
    )
    config = deepspeed_config.resolve(tc, world_size=2, hidden_size=576)
    assert config["train_batch_size"] == 2 * 3 * 2
    # bf16 "auto" follows training.mixed_precision the way DDP computes it (fp32 parameters, autocast)
    assert config["torch_autocast"]["enabled"] is True and config["torch_autocast"]["dtype"] == "bfloat16"
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert config["optimizer"]["params"] == {
        "lr": 3e-6,
        "betas": [0.8, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-6,
        "warmup_num_steps": 5,
        "total_num_steps": 50,
    }
    zero = config["zero_optimization"]
    # HF's sizes from the hidden size h = 576: h^2, 0.9 h^2, 10 h
    assert zero["reduce_bucket_size"] == 576 * 576 == 331776
    assert zero["stage3_prefetch_bucket_size"] == math.floor(0.9 * 576 * 576) == 298598
    assert zero["stage3_param_persistence_threshold"] == 5760
    assert '"auto"' not in json.dumps(config)


def test_an_auto_nobody_fills_is_named(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    tc = TrainingConfig(distributed_strategy="deepspeed", deepspeed_config=str(path))
    with pytest.raises(ConfigError, match="zero_optimization.sub_group_size"):
        deepspeed_config.resolve(tc, world_size=1, hidden_size=64)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    with pytest.raises(ConfigError, match="hidden_size"):
        deepspeed_config.resolve(tc, world_size=1, hidden_size=None)


def test_mixed_precision_auto_picks_by_the_device():
    assert resolve_mixed_precision("fp16", torch.device("cpu")) == ("fp16", "as configured")
    choice, why = resolve_mixed_precision("auto", torch.device("cpu"))
    assert choice == ("bf16" if cpu_has_fast_bf16() else "no")
    assert "bf16" in why
    assert load_config(None, ["training.mixed_precision=auto"]).training.mixed_precision == "auto"


def test_the_safe_mm_dpo_origins_names(tmp_path):
    """NephrenLuca/mmdpo-alignment's flat keys (configs/dpo_config.yaml) are read as dpo.*; a flat
    `beta` is DPO's beta in a dpo run and the KL coefficient in a grpo run (TRL's meanings)."""
    path = tmp_path / "origin.yaml"
    path.write_text(
        yaml.safe_dump(
            {"β_ori": 0.2, "w": 0.7, "k": 0.3, "λ_init": 2.0, "λ_lr": 0.02, "cost_threshold": -0.5},
            allow_unicode=True,
        )
    )
    cfg = load_config(path, method="dpo")
    sm = cfg.dpo.safe_mm
    assert (cfg.dpo.beta, sm.w, sm.k, sm.lambda_init, sm.lambda_lr, sm.cost_threshold) == (
        0.2,
        0.7,
        0.3,
        2.0,
        0.02,
        -0.5,
    )
    assert load_config(None, ["beta=0.3"], method="dpo").dpo.beta == 0.3
    assert load_config(None, ["beta=0.3"], method="grpo").grpo.kl_coef == 0.3
    with pytest.raises(ConfigError, match="beta"):
        load_config(None, ["beta=0.3"], method="sft")
    assert load_config(None, ["kl_coeff=0"], method="dpo").dpo.beta == 0.1
    with pytest.raises(ConfigError, match=r"kl_coeff.*no separate KL term"):
        load_config(None, ["kl_coeff=0.1"], method="dpo")
