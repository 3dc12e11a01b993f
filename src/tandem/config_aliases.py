"""The seeds' and HF TrainingArguments' key names (and the Safe-MM-DPO origin's
`classification_loss_weight`), read as tandem's own (`load_config` applies them).

A config written for the seeds or for HF/TRL trainers (`per_device_train_batch_size`, `bf16: true`,
`lr_scheduler_type`, `warmup_ratio`, `deepspeed: {config_path: ...}`, ...) is taken: each such key
becomes the tandem key it means, and `load_config` logs "X is read as Y" once. A name whose meaning
tandem cannot reproduce is refused with the exact replacement. Keys are looked up at the top level
and in `training:` (HF's flat layout and tandem's sections both occur in the wild).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, get_args

from tandem.config import ConfigError, DistBackend, DistributedStrategy

Assignments = list[tuple[str, Any]]  # (dotted tandem key, value)

_SCHEDULERS = {
    "constant": "constant",
    "constant_with_warmup": "constant",  # tandem's warmup comes from warmup_steps in every schedule
    "linear": "linear",
    "cosine": "cosine",
    "cosine_with_min_lr": "cosine",  # the floor is training.min_lr_ratio
}
_STRATEGIES = get_args(DistributedStrategy)
_BACKENDS = tuple(b for b in get_args(DistBackend) if b != "auto")  # the seeds name a backend, never auto


def _same(key: str) -> Callable[[Any, dict], Assignments]:
    return lambda value, raw: [(key, value)]


def _precision(name: str) -> Callable[[Any, dict], Assignments]:
    """`bf16: true` / `fp16: true` (HF); false says nothing unless both are false."""

    def read(value: Any, raw: dict) -> Assignments:
        if not isinstance(value, bool):
            raise ConfigError(f"`{name}` is {value!r}; it is true or false (or use training.mixed_precision)")
        if value:
            return [("training.mixed_precision", name)]
        return []

    return read


def _lr_scheduler_type(value: Any, raw: dict) -> Assignments:
    if value not in _SCHEDULERS:
        raise ConfigError(
            f"`lr_scheduler_type` is {value!r}; tandem's schedules are training.lr_scheduler: "
            f"constant | linear | cosine (lr_scheduler_type {', '.join(_SCHEDULERS)} are read as them)"
        )
    return [("training.lr_scheduler", _SCHEDULERS[value])]


def _warmup_ratio(value: Any, raw: dict) -> Assignments:
    """HF: warmup over ceil(ratio x total steps); tandem's schedules span training.max_steps."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ConfigError(f"`warmup_ratio` is {value!r}; it must be a fraction in [0, 1]")
    training = raw.get("training") or {}
    max_steps = training.get("max_steps", 200)
    if not isinstance(max_steps, int):
        raise ConfigError("`warmup_ratio` needs an integer training.max_steps to become warmup_steps")
    return [("training.warmup_steps", math.ceil(value * max_steps))]


def _backend(name: str) -> Callable[[Any, dict], Assignments]:
    """The seeds' `distributed_backend` (HF's `ddp_backend`) names a backend or a strategy."""

    def read(value: Any, raw: dict) -> Assignments:
        if value in _BACKENDS:
            return [("training.dist_backend", value)]
        if value in _STRATEGIES:
            return [("training.distributed_strategy", value)]
        raise ConfigError(
            f"`{name}` is {value!r}; set training.dist_backend: nccl | gloo (the process-group backend) "
            f"or training.distributed_strategy: {' | '.join(_STRATEGIES)}"
        )

    return read


def _deepspeed(value: Any, raw: dict) -> Assignments:
    """HF's `deepspeed: path/to/ds.json`, or the seeds' section `deepspeed: {config_path, ...}`."""
    if isinstance(value, str):
        value = {"config_path": value}
    if not isinstance(value, dict):
        raise ConfigError(
            f"`deepspeed` is {value!r}; give training.deepspeed_config: path/to/ds.json "
            "(and training.distributed_strategy: deepspeed)"
        )
    out: Assignments = []
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"`deepspeed.enabled` is {enabled!r}; true or false")
    for key, item in value.items():
        if key == "config_path":
            out.append(("training.deepspeed_config", item))
        elif key in ("zero_stage", "stage"):
            out.append(("training.zero_stage", item))
        elif key == "enabled":
            pass
        else:
            raise ConfigError(
                f"`deepspeed.{key}` is not a setting tandem reads; the DeepSpeed JSON "
                "(training.deepspeed_config) holds DeepSpeed's own options, training.zero_stage and "
                "training.offload_optimizer / offload_param the common ones"
            )
    strategy = (raw.get("training") or {}).get("distributed_strategy")
    if enabled and strategy not in ("deepspeed", "auto"):  # auto may pick DeepSpeed itself
        out.append(("training.distributed_strategy", "deepspeed"))
    return out


def _save_strategy(value: Any, raw: dict) -> Assignments:
    if value == "steps":
        return []  # tandem saves every training.save_steps steps: the same thing
    if value in ("no", False):  # YAML 1.1 reads a bare `no` as false
        return [("training.save_steps", 0)]
    raise ConfigError(
        f"`save_strategy` is {value!r}; tandem saves every training.save_steps optimizer steps (0 = only "
        "the final model): remove save_strategy and set training.save_steps to your steps per epoch"
    )


def _eval_strategy(name: str) -> Callable[[Any, dict], Assignments]:
    def read(value: Any, raw: dict) -> Assignments:
        if value == "steps":
            return []
        if value in ("no", False):
            return [("training.eval_steps", 0)]
        raise ConfigError(
            f"`{name}` is {value!r}; tandem evaluates every training.eval_steps steps (0 = at the end "
            "only): remove it and set training.eval_steps"
        )

    return read


def _beta(value: Any, raw: dict) -> Assignments:
    """A flat `beta`: DPO's beta in a dpo config (the Safe-MM-DPO origin's and TRL's DPOConfig), the
    KL coefficient in a grpo one (TRL's GRPOConfig)."""
    method = raw.get("method", "grpo")
    if method == "dpo":
        return [("dpo.beta", value)]
    if method == "grpo":
        return [("grpo.kl_coef", value)]
    raise ConfigError(f"`beta` means nothing to a {method} run; remove it")


def _kl_coeff(value: Any, raw: dict) -> Assignments:
    """The origin's optional full-vocabulary KL term: 0 means none, which is tandem's form."""
    if value in (0, 0.0, None):
        return []
    raise ConfigError(
        f"`kl_coeff` is {value!r}; tandem's Safe-MM-DPO has no separate KL term (the DPO losses already "
        "keep the policy near the reference, through dpo.beta): remove kl_coeff or set it to 0"
    )


def _refuse(name: str, fix: str) -> Callable[[Any, dict], Assignments]:
    def read(value: Any, raw: dict) -> Assignments:
        raise ConfigError(f"`{name}` is not a tandem setting; {fix}")

    return read


# name -> how it reads; looked up at the top level and in `training:`
SEED_KEYS: dict[str, Callable[[Any, dict], Assignments]] = {
    "per_device_train_batch_size": _same("training.micro_batch_size"),
    "train_micro_batch_size_per_gpu": _same("training.micro_batch_size"),
    "num_train_epochs": _same("training.num_epochs"),
    "lr_scheduler_type": _lr_scheduler_type,
    "warmup_ratio": _warmup_ratio,
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "adam_epsilon": _same("training.adam_eps"),
    "distributed_backend": _backend("distributed_backend"),
    "ddp_backend": _backend("ddp_backend"),
    "deepspeed": _deepspeed,
    "find_unused_parameters": _same("training.ddp_find_unused_parameters"),
    "save_strategy": _save_strategy,
    "eval_strategy": _eval_strategy("eval_strategy"),
    "evaluation_strategy": _eval_strategy("evaluation_strategy"),
    "run_name": _same("experiment_name"),
    "gen_update_steps": _same("pipeline.sync_every"),  # the seeds' weight-sync interval
    # the Safe-MM-DPO origin's flat names (NephrenLuca/mmdpo-alignment configs/dpo_config.yaml)
    "β_ori": _same("dpo.beta"),
    "beta": _beta,
    "w": _same("dpo.safe_mm.w"),
    "k": _same("dpo.safe_mm.k"),
    "λ_init": _same("dpo.safe_mm.lambda_init"),
    "λ_lr": _same("dpo.safe_mm.lambda_lr"),
    "cost_threshold": _same("dpo.safe_mm.cost_threshold"),
    "kl_coeff": _kl_coeff,
    # the Safe-MM-DPO origin's cost-model weight (its rm_config.yaml keeps it at the top level)
    "classification_loss_weight": _same("rm.classification_loss_weight"),
    "per_device_eval_batch_size": _refuse(
        "per_device_eval_batch_size", "held-out batches use training.micro_batch_size: remove it"
    ),
    "gen_device": _refuse(
        "gen_device",
        "place the sampler with `tandem launch CONFIG --sampling-devices N --training-devices M` "
        "(or `tandem sample CONFIG --gpu-id N`)",
    ),
}


def read_seed_keys(raw: dict[str, Any], method: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Return a copy of the raw config with every seed/HF key replaced by tandem's, and one note
    per key ("`training.bf16: true` is read as `training.mixed_precision: bf16`"). A key set both
    ways with different values is refused, naming both."""
    out = copy.deepcopy(raw)
    notes: list[str] = []
    explicit = _explicit_keys(out)
    sections = [("", out)]
    if isinstance(out.get("training"), dict):
        sections.append(("training.", out["training"]))
    for prefix, section in sections:
        for name in [k for k in section if k in SEED_KEYS]:
            value = section.pop(name)
            context = out if method is None or "method" in out else {**out, "method": method}
            assignments = SEED_KEYS[name](value, context)
            for key, new in assignments:
                have = _get_dotted(out, key)
                if key in explicit and have != new:
                    raise ConfigError(
                        f"`{prefix}{name}: {_show(value)}` means `{key}: {_show(new)}`, but the config "
                        f"also sets `{key}: {_show(have)}`; keep one of the two"
                    )
                _set(out, key, new)
                explicit.add(key)  # a second alias of the same key must agree with this one
            read_as = ", ".join(f"`{k}: {_show(v)}`" for k, v in assignments) or "nothing (the default)"
            notes.append(f"`{prefix}{name}: {_show(value)}` is read as {read_as}")
    return out, notes


def read_seed_overrides(
    overrides: list[str], raw: dict[str, Any], method: str | None = None
) -> tuple[list[str], list[str]]:
    """Translate `key=value` overrides that use a seed/HF name into tandem overrides (a command-line
    value wins over the file, whichever name either uses); `raw` is the config they apply to."""
    import json

    import yaml

    out: list[str] = []
    notes: list[str] = []
    for item in overrides:
        key, _, text = item.partition("=")
        prefix, _, name = key.strip().rpartition(".")
        if name not in SEED_KEYS or prefix not in ("", "training"):
            out.append(item)
            continue
        value = yaml.safe_load(text)
        context = raw if method is None or "method" in raw else {**raw, "method": method}
        assignments = SEED_KEYS[name](value, context)
        out += [f"{k}={json.dumps(v)}" for k, v in assignments]
        read_as = ", ".join(f"`{k}={_show(v)}`" for k, v in assignments) or "nothing (the default)"
        notes.append(f"`{key.strip()}={text}` is read as {read_as}")
    return out, notes


def _show(value: Any) -> str:
    """A value as YAML writes it (true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _explicit_keys(raw: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        keys.add(dotted)
        if isinstance(value, dict):
            keys |= _explicit_keys(value, f"{dotted}.")
    return keys


def _get_dotted(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
