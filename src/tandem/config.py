"""The config tree: typed dataclasses, YAML loading with dotted `key=value` overrides, validation, dump.

`load_config("configs/grpo.yaml", ["training.learning_rate=1e-5"])` returns a validated `Config`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math solver. First reason step by step inside <think> </think>. "
    "Then write only the final number inside <answer> </answer>, with nothing after it. "
    "Use exactly this format: <think> reasoning </think><answer> number </answer>"
)

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
REWARD_TYPES = ("answer", "format", "format_partial", "function", "model")
METHODS = ("grpo", "sft", "rm", "dpo", "ppo")
SCALE_REWARDS = ("group", "batch", "none")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
LR_SCHEDULERS = ("constant", "cosine", "linear")
MIXED_PRECISIONS = ("no", "bf16", "fp16", "auto")
REPORTERS = ("tensorboard", "wandb")
DISTRIBUTED_STRATEGIES = ("none", "ddp", "deepspeed", "auto")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DIST_BACKENDS = ("auto", "nccl", "gloo")
PIPELINE_MODES = ("decoupled", "colocated")
SYNC_METHODS = ("zmq", "fs")


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user mistake in the config; the message names the dotted key and the fix."""


@dataclass
class LoraSpec:
    """LoRA adapters through PEFT (models/lora.py)."""

    enabled: bool = False
    r: int = 16  # rank
    alpha: float = 32.0  # scale = alpha / r
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    sync: str = "adapter"  # what samplers receive: adapter (only the LoRA weights) | merged (full weights)


@dataclass
class ModelConfig:
    policy: str = "embedded"  # "embedded" | HF folder | hub id | path/to/model.gguf
    reference: str | None = None  # None = a frozen copy of the policy's initial weights
    reference_offload: bool = False  # load the reference for each batch's log-probs only (less peak memory)
    tokenizer: str | None = None  # None = the policy's
    dtype: str = "float32"  # master weights: float32 | bfloat16 | float16
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    lora: LoraSpec = field(default_factory=LoraSpec)


@dataclass
class DataConfig:
    dataset: str = "synthetic"  # "synthetic" | "gsm8k" (openai/gsm8k) | path to .jsonl/.parquet
    split: str = "train"
    num_examples: int = 2000  # synthetic: how many to generate; files: cap (0 = all)
    difficulty: int = 1  # synthetic data: 1 = one-step small numbers, 2 = up to two steps, numbers < 1000
    eval_dataset: str | None = None  # same forms as dataset; None = held-out synthetic / gsm8k test
    num_eval_examples: int = 200
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    num_shots: int = 1  # worked examples shown before the question, as chat turns
    prefill: str = "<think>"  # text the assistant turn starts with (part of the response)
    shuffle: bool = True


@dataclass
class RewardSpec:
    type: str  # answer | format | format_partial | function | model
    weight: float = 1.0
    function: str | None = None  # "package.module:function" when type == "function"
    path: str | None = None  # type model: a reward model folder written by `tandem rm` (its final/)
    name: str | None = None  # key in reward_info; default = type (or the function's name)

    @property
    def resolved_name(self) -> str:
        """The key this reward gets in reward_info: `name`, else the function's name, else `type`."""
        if self.name:
            return self.name
        if self.type == "function" and self.function:
            return self.function.rpartition(":")[2]
        return self.type


@dataclass
class SamplingConfig:
    num_generations: int = 4  # G completions per prompt (group size)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    dtype: str = "bfloat16"  # rollout copy of the policy: float32 | bfloat16 | float16
    batch_size: int = 32  # sequences per generation call
    num_threads: int = 0  # sampler process CPU threads, 0 = split the cores with the trainer


@dataclass
class GRPOConfig:
    prompts_per_step: int = 8
    scale_rewards: str = "group"  # group | batch | none
    loss_agg: str = "seq-mean-token-mean"  # | token-mean | seq-mean-token-sum-norm
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.04
    num_iterations: int = 1  # optimizer passes over each step's batch
    adv_eps: float = 1e-4  # added to the std when scaling rewards
    skip_zero_variance_groups: bool = False


@dataclass
class SFTConfig:
    """`tandem sft`: supervised fine-tuning on prompt/completion pairs or chat messages."""

    completion_only_loss: bool = True  # loss on completion tokens only (false: on every token)
    packing: bool = False  # several examples per row (block-diagonal attention) instead of padding
    max_length: int = 512  # tokens per example, prompt + completion; longer ones are cut from the end


@dataclass
class RewardModelConfig:
    """`tandem rm`: a Bradley-Terry reward model (a scalar head on a causal LM)."""

    task: str = "helpful"  # helpful | harmless: which built-in preference set data.dataset=synthetic gives
    max_length: int = 512  # tokens per prompt + answer


@dataclass
class SafeMMConfig:
    """Safe-MM-DPO: DPO whose per-pair margin adds the reward models' score gaps (algorithms/dpo.py)."""

    helpful_model: str | None = (
        None  # a `tandem rm` folder (task helpful); None with harmless_model = plain DPO
    )
    harmless_model: str | None = None  # a `tandem rm` folder (task harmless)
    helpful_weight: float = 1.0
    harmless_weight: float = 1.0
    safety_margin: float = 0.0  # added to the margin of pairs whose chosen answer is the safer one

    @property
    def enabled(self) -> bool:
        return self.helpful_model is not None or self.harmless_model is not None


@dataclass
class DPOConfig:
    """`tandem dpo`: direct preference optimisation against a frozen reference."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo
    label_smoothing: float = 0.0  # conservative DPO: the chance a label is flipped
    reference_logps: str = "precompute"  # precompute (once, before training) | online (every batch)
    max_length: int = 512  # tokens per prompt + answer
    task: str = "helpful"  # data.dataset=synthetic: helpful | harmless | mixed (Safe-MM-DPO)
    safe_mm: SafeMMConfig = field(default_factory=SafeMMConfig)


@dataclass
class PPOConfig:
    """`tandem ppo`: PPO with a value head on the policy, on the GRPO sampler/trainer split."""

    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    vf_coef: float = 0.1  # weight of the value loss
    value_learning_rate: float | None = (
        None  # the value head's own learning rate (None: training.learning_rate)
    )
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.05
    kl_mode: str = "reward"  # reward: -kl_coef * KL per token in the reward | loss: a k3 KL term in the loss
    whiten_advantages: bool = True
    num_iterations: int = 2  # optimizer passes over each batch (PPO epochs)


@dataclass
class TrainingConfig:
    max_steps: int = 200
    num_epochs: int = 1  # sft, rm, dpo: passes over the data (training stops at max_steps or here)
    eval_steps: int = 0  # sft, rm, dpo: evaluate every N steps (0 = at the end only)
    learning_rate: float = 1e-6
    lr_scheduler: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine/linear floor as a fraction of learning_rate
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 4
    # no | bf16 | fp16 | auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with
    # AVX512-BF16/AMX), else fp16 on CUDA, else no; the log and config.yaml say what was chosen
    mixed_precision: str = "no"
    max_grad_norm: float = 1.0  # 0 = no clipping
    # a step whose loss or gradient is NaN/inf is skipped (weights unchanged); this many in a row stop the run
    max_nonfinite_steps: int = 10
    gradient_checkpointing: bool = False
    save_steps: int = 50  # 0 = only the final save
    save_total_limit: int = 2  # 0 = keep all
    logging_steps: int = 1
    sample_log_steps: int = 10  # write completions to samples/ every N steps (0 = never)
    report_to: list[str] = field(default_factory=list)  # subset of {"tensorboard", "wandb"}
    resume_from_checkpoint: str | None = None  # "latest" | path to checkpoints/step-N
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int = 0  # torch CPU threads, 0 = torch default
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (false: full fp32, slower)
    # none: one process | ddp | deepspeed (ZeRO) | auto: < 1B parameters ddp, 1-7B ZeRO-2, > 7B ZeRO-3
    distributed_strategy: str = "none"
    zero_stage: int = 2  # deepspeed: 1 (optimizer states) | 2 (+ gradients) | 3 (+ parameters) sharded
    offload_optimizer: str = "none"  # deepspeed: none | cpu | nvme (optimizer states off the GPU)
    offload_param: str = "none"  # deepspeed ZeRO-3: none | cpu | nvme (parameters off the GPU)
    # ZeRO-3: load the policy (and DPO's reference) under deepspeed.zero.Init, each rank holding only
    # its shard from the start; false: every rank loads the whole model, then DeepSpeed shards it
    # (for model code that zero.Init cannot build, or to compare with that path)
    zero3_init: bool = True
    nvme_path: str | None = None  # folder for nvme offload
    deepspeed_config: str | None = None  # a DeepSpeed JSON ("auto" values are filled from this config)
    dist_backend: str = "auto"  # auto (nccl on GPUs, gloo on the CPU) | nccl | gloo
    # bf16 under DeepSpeed: autocast (fp32 parameters, forward under torch.autocast, fp32 gradient
    # reduction: computes as DDP does; ZeRO-1/2 hold 4 bytes per parameter replicated instead of 2)
    # | native (DeepSpeed's bf16 mode: bf16 parameters, fp32 master copy; less memory, other rounding)
    deepspeed_bf16: str = "autocast"
    # DistributedDataParallel options (strategy ddp), under the names HF TrainingArguments uses
    ddp_find_unused_parameters: bool = False  # true for models whose forward skips some parameters
    ddp_bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size
    ddp_broadcast_buffers: bool = True  # broadcast module buffers from rank 0 at every forward
    # a collective waits this long for a slow rank (rank 0 saving); waiting for samplers never counts
    dist_timeout_s: float = 1800.0


@dataclass
class CurveConfig:
    """CURVE keys (made by `tandem keygen DIR`); all null = no authentication, plain TCP."""

    server_secret_key: str | None = None  # trainer: its .key_secret file
    authorized_clients: str | None = None  # trainer: folder of the samplers' public .key files
    server_public_key: str | None = None  # sampler: the trainer's public .key file
    client_secret_key: str | None = None  # sampler: its own .key_secret file

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))


@dataclass
class PipelineConfig:
    """The decoupled sampler/trainer pipeline (DESIGN.md sections 1-4)."""

    mode: str = "decoupled"  # decoupled: sampler and trainer processes | colocated: one process
    num_samplers: int = 1  # samplers that `tandem grpo` starts / that share the work of a version
    trainer_host: str = "127.0.0.1"  # where samplers find the trainer
    bind_host: str = "*"  # the interface the trainer binds ("*" = all)
    data_port: int = 5555  # groups, sampler PUSH -> trainer PULL
    sync_port: int = 5556  # weights and status, trainer ROUTER <-> sampler DEALER
    sync_method: str = "zmq"  # zmq (from memory) | fs (files in sync_dir)
    sync_dir: str | None = None  # fs method; None = <run_dir>/weights
    sync_every: int = 1  # publish new weights every N optimizer steps (the seed's gen_update_steps)
    sync_dtype: str | None = None  # dtype the weights travel in; None = the trainer's
    sync_keep_versions: int = 2  # fs method: versions kept on disk
    max_staleness: int = 1  # drop groups more than N versions old (0 = strictly on-policy)
    send_hwm: int = 4  # groups queued in a sampler before it blocks
    recv_hwm: int = 4  # groups queued per sampler in the trainer before senders block
    max_message_mb: int = 64  # ZMQ_MAXMSGSIZE of the data channel
    data_warn_s: float = 60.0  # trainer: say so when no group arrived for this long
    data_timeout_s: float = 0.0  # trainer: give up after this long without a group (0 = never)
    trainer_timeout_s: float = 0.0  # sampler: give up after this long without the trainer (0 = never)
    curve: CurveConfig = field(default_factory=CurveConfig)


@dataclass
class Config:
    method: str = "grpo"  # grpo | sft | rm | dpo | ppo: the command that runs this config
    experiment_name: str = "grpo"
    output_dir: str = "runs"  # the run folder is output_dir/experiment_name
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("answer"), RewardSpec("format")])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.experiment_name


# ---------------------------------------------------------------- dict -> dataclasses

T = TypeVar("T")


def config_from_dict(d: dict[str, Any], cls: type[T] = Config) -> T:  # type: ignore[assignment]
    """Build `cls` from a nested dict, checking every key and type against the dataclass hints."""
    return _from_dict(d, cls, "")


def _from_dict(d: Any, cls: type[T], prefix: str) -> T:
    if not isinstance(d, dict):
        where = f"`{prefix}`" if prefix else "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {d!r} ({type(d).__name__})")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(str(key), cls, prefix))
        kwargs[key] = _convert(value, hints[key], _join(prefix, key))
    for f in fields.values():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in kwargs:
            raise ConfigError(
                f"`{_join(prefix, f.name)}` is required; add it (expects {_type_name(hints[f.name])})"
            )
    return cls(**kwargs)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key_message(key: str, cls: type, prefix: str) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    if not close:  # a key one section too high, e.g. `learning_rate` for `training.learning_rate`
        sections = [
            (f.name, [g.name for g in dataclasses.fields(sub)])
            for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(sub := typing.get_type_hints(cls)[f.name])
        ]
        exact = [f"{section}.{key}" for section, keys in sections if key in keys]
        near = [
            (difflib.SequenceMatcher(None, key, match).ratio(), f"{section}.{match}")
            for section, keys in sections
            for match in difflib.get_close_matches(key, keys, n=1)
        ]
        if exact:  # the first section that has it (grpo before ppo for kl_coef)
            close = exact[:1]
        elif near:
            close = [max(near)[1]]
    hint = f"did you mean `{_join(prefix, close[0])}`?" if close else f"valid keys here: {', '.join(names)}"
    return f"unknown config key `{_join(prefix, key)}`; {hint}"


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
    if origin is list:
        if not isinstance(value, list):
            hint = f"write it as a list, e.g. [{value}]" if isinstance(value, (str, int, float)) else ""
            raise _type_error(key, tp, value, hint)
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _from_dict(value, tp, key)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, str):
        return value
    if tp is str and value is False and "no" in _CHOICES.get(key, ()):  # YAML 1.1 reads a bare `no` as false
        return "no"
    assert tp in (bool, int, float, str), f"config field `{key}` has an unsupported type {tp}"
    hint = "quote the value so YAML reads it as a string" if tp is str and value is not None else ""
    raise _type_error(key, tp, value, hint)


def _type_error(key: str, tp: Any, value: Any, hint: str = "") -> ConfigError:
    fix = f"; {hint}" if hint else ""
    return ConfigError(
        f"config key `{key}` expects {_type_name(tp)}, got {value!r} ({type(value).__name__}){fix}"
    )


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(tp) is list:
        return f"a list of ({_type_name(args[0])})"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


# ---------------------------------------------------------------- overrides, load, dump


def apply_overrides(d: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `d` with dotted `key=value` pairs set; values are parsed as YAML."""
    out = copy.deepcopy(d) if d else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} must have the form key=value, e.g. training.learning_rate=1e-5"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override `{key}`: cannot parse {raw!r} as YAML ({e}); quote the value") from e
        _set_dotted(out, key, value)
    return out


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if "" in parts:
        raise ConfigError(f"override key `{key}` has an empty part; write it like training.learning_rate")
    node: Any = d
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, dict) and node.get(part) is None:
            if parts[i + 1].isdigit():
                raise ConfigError(f"override `{key}`: the list `{here}` is not in the file; set it whole")
            node[part] = {}  # a section absent from the file (or left empty)
        node = node[_index(node, part, key, here)]
    node[_index(node, parts[-1], key, key)] = value


def _index(node: Any, part: str, key: str, here: str) -> str | int:
    if isinstance(node, list):  # e.g. rewards.0.weight=2
        if not part.isdigit() or int(part) >= len(node):
            raise ConfigError(f"override `{key}`: `{here}` must index the list (0..{len(node) - 1})")
        return int(part)
    if not isinstance(node, dict):
        raise ConfigError(f"override `{key}`: `{here.rpartition('.')[0]}` is a value, not a section")
    return part


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, method: str | None = None
) -> Config:
    """Read a YAML file (None = all defaults), apply overrides, convert and validate.

    `method` is the command's (`tandem sft` passes "sft"): a file written for another method is
    refused rather than trained with the wrong loop."""
    raw: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML file (see configs/)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML; fix the syntax: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values at the top level")
    from tandem.config_aliases import read_seed_keys, read_seed_overrides

    # seed/HF key names (config_aliases.py): the file's first, then the overrides', which win
    raw, notes = read_seed_keys(raw)
    overrides, override_notes = read_seed_overrides(list(overrides), apply_overrides(raw, overrides))
    for note in notes + override_notes:
        log.info(note)
    merged = apply_overrides(raw, overrides)
    if method is not None:
        check_method(merged, raw, method, path)
        merged["method"] = method
    cfg = config_from_dict(merged)
    validate(cfg)
    return cfg


# sections only one family of commands reads: a file with them and no `method:` is for that family
_METHOD_SECTIONS = {
    "grpo": ("grpo", "sampling", "rewards", "pipeline"),
    "ppo": ("ppo",),
    "sft": ("sft",),
    "rm": ("rm",),
    "dpo": ("dpo",),
}


def check_method(merged: dict[str, Any], raw: dict[str, Any], method: str, path: Path | None) -> None:
    """Refuse a config written for another method before anything loads. A file without `method:`
    says what it is by its sections: `grpo:`/`sampling:`/`rewards:`/`pipeline:` make a GRPO (or PPO)
    config, `sft:`, `rm:`, `dpo:`, `ppo:` their method's."""
    stated = merged.get("method")
    if stated is not None:
        if stated != method:
            raise ConfigError(
                f"`method` is {stated!r} in this config but the command is `tandem {method}`; "
                f"run it with `tandem {stated}`, or set method: {method}"
            )
        return
    implied = {m for m, sections in _METHOD_SECTIONS.items() if any(s in raw for s in sections)}
    if "ppo" in implied:
        implied.discard("grpo")  # PPO configs use GRPO's sampling/rewards/pipeline sections too
    compatible = {method} | ({"grpo"} if method == "ppo" else set())
    if len(implied) == 1 and not implied & compatible:
        (other,) = implied
        found = [s for s in _METHOD_SECTIONS[other] if s in raw]
        raise ConfigError(
            f"{path} has no `method:` key and its sections ({', '.join(found)}) make it a {other} config, "
            f"but the command is `tandem {method}`; run it with `tandem {other}`, or add `method: {method}` "
            "to the file if it is meant for this command"
        )


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the fully resolved config as YAML that `load_config` reads back to an equal Config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True))


# ---------------------------------------------------------------- validation

_CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "rm.task": ("helpful", "harmless"),
    "dpo.loss_type": ("sigmoid", "ipo"),
    "dpo.reference_logps": ("precompute", "online"),
    "dpo.task": ("helpful", "harmless", "mixed"),
    "ppo.kl_mode": ("reward", "loss"),
    "model.dtype": DTYPES,
    "model.attn_implementation": ATTN_IMPLEMENTATIONS,
    "sampling.dtype": DTYPES,
    "grpo.scale_rewards": SCALE_REWARDS,
    "grpo.loss_agg": LOSS_AGGS,
    "training.lr_scheduler": LR_SCHEDULERS,
    "training.mixed_precision": MIXED_PRECISIONS,
    "training.distributed_strategy": DISTRIBUTED_STRATEGIES,
    "training.offload_optimizer": OFFLOAD_DEVICES,
    "training.offload_param": OFFLOAD_DEVICES,
    "training.dist_backend": DIST_BACKENDS,
    "training.deepspeed_bf16": ("autocast", "native"),
    "model.lora.sync": ("adapter", "merged"),
    "pipeline.mode": PIPELINE_MODES,
    "pipeline.sync_method": SYNC_METHODS,
}

# (dotted key, check, what it must be)
_BOUNDS: list[tuple[str, Callable[[Any], bool], str]] = [
    ("seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    ("data.num_examples", lambda v: v >= 0, ">= 0 (0 = all)"),
    (
        "data.difficulty",
        lambda v: v in (1, 2),
        "1 (one step, small numbers) or 2 (up to two steps, numbers < 1000)",
    ),
    ("data.num_eval_examples", lambda v: v >= 0, ">= 0"),
    ("data.num_shots", lambda v: v >= 0, ">= 0"),
    ("sampling.num_generations", lambda v: v >= 1, ">= 1"),
    ("sampling.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("sampling.temperature", lambda v: v > 0, "> 0"),
    ("sampling.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("sampling.top_k", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("sampling.batch_size", lambda v: v >= 1, ">= 1"),
    ("grpo.prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("grpo.clip_eps_low", lambda v: v >= 0, ">= 0"),
    ("grpo.clip_eps_high", lambda v: v >= 0, ">= 0"),
    ("grpo.kl_coef", lambda v: v >= 0, ">= 0 (0 = no KL term)"),
    ("grpo.num_iterations", lambda v: v >= 1, ">= 1"),
    ("grpo.adv_eps", lambda v: v >= 0, ">= 0"),
    ("training.max_steps", lambda v: v >= 1, ">= 1"),
    ("training.num_epochs", lambda v: v >= 1, ">= 1"),
    ("training.eval_steps", lambda v: v >= 0, ">= 0 (0 = at the end only)"),
    ("sft.max_length", lambda v: v >= 2, ">= 2"),
    ("rm.max_length", lambda v: v >= 2, ">= 2"),
    ("dpo.max_length", lambda v: v >= 2, ">= 2"),
    ("dpo.beta", lambda v: v > 0, "> 0"),
    ("dpo.label_smoothing", lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    ("ppo.clip_eps", lambda v: v >= 0, ">= 0"),
    ("ppo.value_clip_eps", lambda v: v >= 0, ">= 0"),
    ("ppo.vf_coef", lambda v: v >= 0, ">= 0"),
    ("ppo.value_learning_rate", lambda v: v is None or v > 0, "> 0, or null for training.learning_rate"),
    ("ppo.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("ppo.lam", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("ppo.kl_coef", lambda v: v >= 0, ">= 0"),
    ("ppo.num_iterations", lambda v: v >= 1, ">= 1"),
    ("training.learning_rate", lambda v: v > 0, "> 0"),
    ("training.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("training.dist_timeout_s", lambda v: v >= 1, ">= 1 (seconds)"),
    ("training.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("training.weight_decay", lambda v: v >= 0, ">= 0"),
    ("training.adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("training.adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("training.adam_eps", lambda v: v > 0, "> 0"),
    ("training.micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("training.gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("training.max_grad_norm", lambda v: v >= 0, ">= 0 (0 = no clipping)"),
    ("training.max_nonfinite_steps", lambda v: v >= 1, ">= 1"),
    ("training.save_steps", lambda v: v >= 0, ">= 0 (0 = only the final save)"),
    ("training.save_total_limit", lambda v: v >= 0, ">= 0 (0 = keep all)"),
    ("training.logging_steps", lambda v: v >= 1, ">= 1"),
    ("training.sample_log_steps", lambda v: v >= 0, ">= 0 (0 = never)"),
    ("training.num_threads", lambda v: v >= 0, ">= 0 (0 = torch default)"),
    ("training.ddp_bucket_cap_mb", lambda v: v > 0, "> 0 (megabytes)"),
    ("training.zero_stage", lambda v: v in (1, 2, 3), "1, 2 or 3"),
    ("model.lora.r", lambda v: v >= 1, ">= 1"),
    ("model.lora.alpha", lambda v: v > 0, "> 0"),
    ("model.lora.dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("sampling.num_threads", lambda v: v >= 0, ">= 0 (0 = share the cores with the trainer)"),
    ("pipeline.num_samplers", lambda v: v >= 1, ">= 1"),
    ("pipeline.data_port", lambda v: 0 < v < 65536, "a TCP port in 1..65535"),
    ("pipeline.sync_port", lambda v: 0 < v < 65536, "a TCP port in 1..65535"),
    ("pipeline.sync_every", lambda v: v >= 1, ">= 1"),
    ("pipeline.sync_keep_versions", lambda v: v >= 1, ">= 1"),
    ("pipeline.max_staleness", lambda v: v >= 0, ">= 0 (0 = strictly on-policy)"),
    ("pipeline.send_hwm", lambda v: v >= 1, ">= 1"),
    ("pipeline.recv_hwm", lambda v: v >= 1, ">= 1"),
    ("pipeline.max_message_mb", lambda v: v >= 1, ">= 1"),
    ("pipeline.data_warn_s", lambda v: v > 0, "> 0"),
    ("pipeline.data_timeout_s", lambda v: v >= 0, ">= 0 (0 = wait forever)"),
    ("pipeline.trainer_timeout_s", lambda v: v >= 0, ">= 0 (0 = wait forever)"),
]

_FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    """Cross-field checks on a converted Config; raises ConfigError naming the key and the fix."""
    name = cfg.experiment_name
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(
            f"`experiment_name` is {name!r}; use a plain folder name without '/' (e.g. gsm8k-grpo)"
        )
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"`{key}` is {_get(cfg, key)!r}; choose one of: {', '.join(choices)}")
    for key, ok, must_be in _BOUNDS:
        if not ok(_get(cfg, key)):
            raise ConfigError(f"`{key}` is {_get(cfg, key)!r}; it must be {must_be}")
    for i, reporter in enumerate(cfg.training.report_to):
        if reporter not in REPORTERS:
            raise ConfigError(
                f"`training.report_to[{i}]` is {reporter!r}; choose from: {', '.join(REPORTERS)}"
            )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.training.device):
        raise ConfigError(f"`training.device` is {cfg.training.device!r}; use auto, cpu, cuda or cuda:N")
    if cfg.method == "grpo" and cfg.sampling.num_generations < 2:
        raise ConfigError(
            f"`sampling.num_generations` is {cfg.sampling.num_generations}; GRPO needs >= 2 "
            "(a group of one completion has no advantage)"
        )
    if cfg.method in ("grpo", "ppo"):
        _validate_rewards(cfg.rewards)
        validate_batch(cfg)
    if cfg.method == "dpo" and cfg.dpo.safe_mm.enabled and cfg.dpo.loss_type != "sigmoid":
        raise ConfigError(
            "`dpo.safe_mm` is set with dpo.loss_type=ipo; Safe-MM-DPO's margin is defined for the "
            "sigmoid loss: set dpo.loss_type=sigmoid"
        )
    _validate_distributed(cfg.training)
    _validate_pipeline(cfg.pipeline)


def _validate_distributed(tc: TrainingConfig) -> None:
    deepspeed_only = {
        "zero_stage": tc.zero_stage != 2,
        "offload_optimizer": tc.offload_optimizer != "none",
        "offload_param": tc.offload_param != "none",
        "deepspeed_config": tc.deepspeed_config is not None,
    }
    if tc.distributed_strategy in ("none", "ddp"):
        for key, is_set in deepspeed_only.items():
            if is_set:
                raise ConfigError(
                    f"`training.{key}` is set but `training.distributed_strategy` is "
                    f"{tc.distributed_strategy!r}; it applies to DeepSpeed: set training.distributed_strategy=deepspeed"
                )
    if tc.offload_param != "none" and tc.zero_stage != 3 and tc.distributed_strategy == "deepspeed":
        raise ConfigError(
            f"`training.offload_param` is {tc.offload_param!r} with training.zero_stage={tc.zero_stage}; "
            "parameters are sharded (and offloaded) only by ZeRO-3: set training.zero_stage=3"
        )
    if "nvme" in (tc.offload_optimizer, tc.offload_param) and not tc.nvme_path:
        raise ConfigError("`training.nvme_path` is unset; NVMe offload needs a folder on a fast local disk")


def _validate_pipeline(p: PipelineConfig) -> None:
    if p.data_port == p.sync_port:
        raise ConfigError(
            f"`pipeline.sync_port` equals `pipeline.data_port` ({p.data_port}); give the two channels "
            "different ports (default 5555 and 5556)"
        )
    if p.sync_dtype is not None and p.sync_dtype not in DTYPES:
        raise ConfigError(
            f"`pipeline.sync_dtype` is {p.sync_dtype!r}; choose one of: {', '.join(DTYPES)} or null"
        )
    curve = p.curve
    if curve.enabled:
        trainer = curve.server_secret_key, curve.authorized_clients
        sampler = curve.server_public_key, curve.client_secret_key
        if (None in trainer and any(trainer)) or (None in sampler and any(sampler)):
            raise ConfigError(
                "`pipeline.curve` is half set: the trainer needs server_secret_key and authorized_clients, "
                "a sampler needs server_public_key and client_secret_key (make them with `tandem keygen DIR`)"
            )


def _validate_rewards(rewards: list[RewardSpec]) -> None:
    if not rewards:
        raise ConfigError("`rewards` is empty; add at least one, e.g. rewards: [{type: answer}]")
    seen: set[str] = set()
    for i, spec in enumerate(rewards):
        key = f"rewards[{i}]"
        if spec.type not in REWARD_TYPES:
            raise ConfigError(f"`{key}.type` is {spec.type!r}; choose one of: {', '.join(REWARD_TYPES)}")
        if spec.type == "function" and not (spec.function and _FUNCTION_SPEC.match(spec.function)):
            raise ConfigError(
                f"`{key}.function` is {spec.function!r}; type function needs it as 'package.module:function'"
            )
        if spec.type != "function" and spec.function is not None:
            raise ConfigError(
                f"`{key}.function` is set but `{key}.type` is {spec.type!r}; set type: function"
            )
        if spec.type == "model" and not spec.path:
            raise ConfigError(f"`{key}.path` is unset; type model needs the folder a `tandem rm` run wrote")
        if spec.type != "model" and spec.path is not None:
            raise ConfigError(f"`{key}.path` is set but `{key}.type` is {spec.type!r}; set type: model")
        if spec.resolved_name in seen:
            raise ConfigError(
                f"`{key}.name`: two rewards are named {spec.resolved_name!r}; give each a distinct name"
            )
        seen.add(spec.resolved_name)


def validate_batch(cfg: Config, world_size: int = 1) -> None:
    """One optimizer step consumes micro_batch_size x gradient_accumulation_steps x world_size
    sequences (DeepSpeed's train_batch_size); that must divide what one step samples."""
    prompts, group = cfg.grpo.prompts_per_step, cfg.sampling.num_generations
    micro, accum = cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps
    num_sequences = prompts * group
    per_rank, rem = divmod(num_sequences, world_size)
    if rem == 0 and per_rank % (micro * accum) == 0:
        return
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    fits = [a for a in range(1, per_rank // micro + 1) if rem == 0 and per_rank % (micro * a) == 0]
    if fits:
        fix = f"set training.gradient_accumulation_steps to one of {fits}"
    elif rem == 0:
        divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        fix = (
            f"set training.micro_batch_size to a divisor of {per_rank} ({divisors}), then adjust accumulation"
        )
    else:
        fix = f"make grpo.prompts_per_step * sampling.num_generations a multiple of the {world_size} ranks"
    raise ConfigError(
        f"`training.gradient_accumulation_steps`: one step samples grpo.prompts_per_step * "
        f"sampling.num_generations = {prompts} * {group} = {num_sequences} sequences, but one optimizer step "
        f"consumes training.micro_batch_size * training.gradient_accumulation_steps{ranks} = "
        f"{micro} * {accum}{ranks} = {micro * accum * world_size}, which does not divide {num_sequences}; {fix}"
    )
