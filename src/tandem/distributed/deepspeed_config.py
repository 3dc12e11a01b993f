"""The DeepSpeed JSON, generated from the YAML or read from a file and checked against it.

A file may say "auto" wherever HF's DeepSpeed integration fills a value: batch sizes,
accumulation, clipping, precision, the optimizer's and scheduler's parameters, and the ZeRO bucket
sizes that depend on the model's hidden size; tandem fills those in. An explicit value that
disagrees with the YAML is an error naming both, and an "auto" nobody fills is an error naming the
key, never a DeepSpeed traceback later. Optimizer and scheduler are tandem's own
(AdamW and the warmup + constant/linear/cosine schedule of `distributed/optim.py`, handed to
DeepSpeed as client objects) unless the file has its own "optimizer"/"scheduler" section.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.config import ConfigError, TrainingConfig


def strategy_for(num_parameters: int, strategy: str, zero_stage: int) -> tuple[str, int]:
    """`auto` follows the seeds' rule: < 1B parameters DDP, 1-7B ZeRO-2, > 7B ZeRO-3."""
    if strategy != "auto":
        return strategy, zero_stage
    if num_parameters < 1e9:
        return "ddp", zero_stage
    return "deepspeed", 2 if num_parameters <= 7e9 else 3


def generated(tc: TrainingConfig, world_size: int, stage: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config this training config implies (`stage`: auto's choice, else zero_stage)."""
    stage = tc.zero_stage if stage is None else stage
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "allgather_bucket_size": 5e7,
    }
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    for key, where in (("offload_optimizer", tc.offload_optimizer), ("offload_param", tc.offload_param)):
        if where != "none":
            zero[key] = {"device": where, "pin_memory": where == "cpu"}
            if where == "nvme":
                zero[key]["nvme_path"] = tc.nvme_path
    return {
        "train_micro_batch_size_per_gpu": tc.micro_batch_size,
        "gradient_accumulation_steps": tc.gradient_accumulation_steps,
        "train_batch_size": tc.micro_batch_size * tc.gradient_accumulation_steps * world_size,
        "gradient_clipping": tc.max_grad_norm,
        "bf16": {"enabled": tc.mixed_precision == "bf16"},
        "fp16": {"enabled": tc.mixed_precision == "fp16", "initial_scale_power": 16},
        "zero_optimization": zero,
        # tandem's AdamW is a torch optimizer; let ZeRO (and its CPU offload) take it
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def zero3_init_config(
    tc: TrainingConfig,
    world_size: int,
    dtype: str,
    num_parameters: Callable[[], int],
    hidden_size: int | None = None,
) -> dict[str, Any] | None:
    """The config to build a model under deepspeed.zero.Init with, when this run trains with ZeRO-3
    and `training.zero3_init` is on; else None. `num_parameters()` is asked only under `auto`, whose
    choice depends on the size. zero.Init casts the shards to the config's precision, fp32 without
    mixed precision: there this config names `dtype` (model.dtype) instead, so the shards are what
    a whole load gives and a bfloat16 model is not doubled."""
    if not tc.zero3_init or tc.distributed_strategy not in ("deepspeed", "auto"):
        return None
    size = num_parameters() if tc.distributed_strategy == "auto" else 0
    strategy, stage = strategy_for(size, tc.distributed_strategy, tc.zero_stage)
    if strategy != "deepspeed":
        return None
    config = resolve(tc, world_size, stage, hidden_size)
    if int(config["zero_optimization"]["stage"]) != 3:
        return None
    if not (config["bf16"]["enabled"] or config["fp16"]["enabled"]):
        config["bf16"] = {"enabled": dtype == "bfloat16"}
        config["fp16"] = {"enabled": dtype == "float16"}
    return config


def resolve(
    tc: TrainingConfig, world_size: int, stage: int | None = None, hidden_size: int | None = None
) -> dict[str, Any]:
    """The generated config, or the user's file with "auto" filled and every explicit value checked.

    A file's `zero_optimization` is its own (stage, offload, buckets); "auto" there takes the
    YAML's value, or for the buckets HF's sizes from the model's `hidden_size`."""
    ours = generated(tc, world_size, stage)
    as_autocast = bf16_as_autocast if tc.deepspeed_bf16 == "autocast" else (lambda config: config)
    if tc.deepspeed_config is None:
        return as_autocast(ours)
    path = Path(tc.deepspeed_config)
    try:
        theirs = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"`training.deepspeed_config`: no file {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"`training.deepspeed_config`: {path} is not valid JSON ({e})") from None
    chose_bf16 = isinstance(theirs.get("bf16"), dict) and theirs["bf16"].get("enabled") is True
    merged = _merge(theirs, ours, path)
    if not chose_bf16 and "torch_autocast" not in theirs:  # the file left precision to the YAML
        merged = as_autocast(merged)
    elif not chose_bf16 and merged.get("torch_autocast", {}).get("enabled"):
        merged["bf16"] = {**merged.get("bf16", {}), "enabled": False}  # the file's own autocast rules
    _fill_optimizer(merged, tc)
    _fill_buckets(merged, hidden_size, path)
    left = _autos(merged)
    if left:
        raise ConfigError(
            f'`training.deepspeed_config`: {path} leaves {", ".join(left)} as "auto", which neither tandem '
            "nor HF's integration fills; give a value there"
        )
    return merged


def bf16_as_autocast(config: dict) -> dict:
    """bf16 the way DDP does it (`training.deepspeed_bf16: autocast`): fp32 parameters, the forward
    under torch.autocast (DeepSpeed's `torch_autocast` section), every gradient reduced in fp32 (no
    "lower precision safe" modules). DeepSpeed's own `bf16` mode (`native`) keeps the parameters in
    bf16 and switches tandem's autocast off inside the engine, so a ZeRO run computes differently from
    a DDP or single-process run of the same config.

    The price is memory and traffic, not sharded away below ZeRO-3: every rank holds the parameters
    in fp32 (4 bytes each instead of 2; DeepSpeed still keeps its own fp32 master partition beside
    them), ZeRO-1 every rank's full gradients in fp32, and gradients are reduced in fp32 (twice the
    bytes). A 7B policy under ZeRO-2 holds 28 GB of parameters per GPU instead of 14. ZeRO-3 reuses its
    fp32 partition as the master copy but gathers fp32 parameters. A DeepSpeed JSON that sets
    `bf16.enabled: true` itself keeps DeepSpeed's mode. fp16 stays DeepSpeed's own (its dynamic loss
    scaling: the autocast path has no scaler under ZeRO)."""
    if not config.get("bf16", {}).get("enabled"):
        return config
    out = {**config, "bf16": {**config["bf16"], "enabled": False}}
    out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    return out


def _fill_optimizer(config: dict, tc: TrainingConfig) -> None:
    """A file's own optimizer / scheduler: their "auto" parameters from the YAML, as HF fills them
    (tandem's schedules span training.max_steps; warmup starts from 0)."""
    values = {
        ("optimizer", "lr"): tc.learning_rate,
        ("optimizer", "betas"): [tc.adam_beta1, tc.adam_beta2],
        ("optimizer", "eps"): tc.adam_eps,
        ("optimizer", "weight_decay"): tc.weight_decay,
        ("scheduler", "warmup_min_lr"): 0.0,
        ("scheduler", "warmup_max_lr"): tc.learning_rate,
        ("scheduler", "warmup_num_steps"): tc.warmup_steps,
        ("scheduler", "total_num_steps"): tc.max_steps,
        ("scheduler", "warmup_min_ratio"): 0.0,  # WarmupCosineLR
        ("scheduler", "cos_min_ratio"): tc.min_lr_ratio,
    }
    for (section, key), value in values.items():
        params = config.get(section, {}).get("params", {})
        if params.get(key) == "auto":
            params[key] = value
    amp = config.get("amp")
    if isinstance(amp, dict) and amp.get("enabled") == "auto":
        amp["enabled"] = False  # apex AMP: tandem's fp16 is DeepSpeed's own (fp16.enabled)


def _fill_buckets(config: dict, hidden_size: int | None, path: Path) -> None:
    """HF's sizes: reduce bucket h^2, ZeRO-3 prefetch 0.9 h^2, parameters under 10 h elements stay
    whole on every rank."""
    zero = config.get("zero_optimization", {})
    sizes = {
        "reduce_bucket_size": lambda h: h * h,
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    for key, size in sizes.items():
        if zero.get(key) != "auto":
            continue
        if hidden_size is None:
            raise ConfigError(
                f'`training.deepspeed_config`: {path} sets zero_optimization.{key} to "auto", which needs '
                "the model's hidden_size (its config.json has none); give a number"
            )
        zero[key] = size(hidden_size)


def _autos(node: Any, where: str = "") -> list[str]:
    if node == "auto":
        return [where]
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _autos(v, f"{where}.{k}" if where else k)]
    return []


# (DeepSpeed key path, the tandem key that decides it)
_CHECKED = [
    (("train_micro_batch_size_per_gpu",), "training.micro_batch_size"),
    (("gradient_accumulation_steps",), "training.gradient_accumulation_steps"),
    (("train_batch_size",), "training.micro_batch_size x gradient_accumulation_steps x ranks"),
    (("gradient_clipping",), "training.max_grad_norm"),
    (("bf16", "enabled"), "training.mixed_precision"),
    (("fp16", "enabled"), "training.mixed_precision"),
]
_FILLED = [("stage",), ("offload_optimizer", "device"), ("offload_param", "device")]


def _merge(theirs: dict, ours: dict, path: Path) -> dict:
    merged = json.loads(json.dumps(theirs))
    for keys, tandem_key in _CHECKED:
        want = ours
        for k in keys:
            want = want[k]
        node = merged
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        have = node.get(keys[-1], "auto")
        if have == "auto":
            node[keys[-1]] = want
        elif have != want:
            raise ConfigError(
                f"`training.deepspeed_config`: {path} sets {'.'.join(keys)}={have!r} but {tandem_key} "
                f'gives {want!r}; set it to "auto" in the JSON (or change {tandem_key})'
            )
    zero = merged.setdefault("zero_optimization", {})
    for keys in _FILLED:
        node, want = zero, ours["zero_optimization"]
        for k in keys[:-1]:
            node, want = node.setdefault(k, {}), want.get(k, {"device": "none"})
        if node.get(keys[-1], "auto") == "auto":
            node[keys[-1]] = want.get(keys[-1], "none")
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print"):
        merged.setdefault(key, ours[key])
    return merged
