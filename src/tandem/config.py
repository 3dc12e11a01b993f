"""The config tree: typed dataclasses whose fields carry their choices (`Literal`) and whose sections
check their own bounds (`check()`), plus `load_config`, validation across sections and dump.

`load_config("configs/grpo.yaml", ["training.learning_rate=1e-5"])` returns a validated `Config`;
the conversion from YAML and overrides is config_convert.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from tandem.config_convert import ConfigError, apply_overrides, from_dict, join, read_yaml

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Config",
    "ConfigError",
    "CurveConfig",
    "DPOConfig",
    "DataConfig",
    "GRPOConfig",
    "LoraSpec",
    "ModelConfig",
    "OVERLONG_KWARGS",
    "PPOConfig",
    "PipelineConfig",
    "RewardModelConfig",
    "RewardSpec",
    "SFTConfig",
    "SafeMMConfig",
    "SamplingConfig",
    "TrainingConfig",
    "apply_overrides",
    "check_method",
    "check_rewards",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "overlong_lengths",
    "validate",
    "validate_batch",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math solver. First reason step by step inside <think> </think>. "
    "Then write only the final number inside <answer> </answer>, with nothing after it. "
    "Use exactly this format: <think> reasoning </think><answer> number </answer>"
)

# choice sets that several fields (or the CLI) share; a field's own set is written on the field.
# `typing.get_args(Method)` gives the tuple.
Method = Literal["grpo", "sft", "rm", "dpo", "ppo"]
Dtype = Literal["float32", "bfloat16", "float16"]
RewardType = Literal["answer", "format", "format_partial", "overlong", "function", "model"]
PreferenceTask = Literal["helpful", "harmless"]
DistributedStrategy = Literal["none", "ddp", "deepspeed", "auto"]
DistBackend = Literal["auto", "nccl", "gloo"]
OffloadDevice = Literal["none", "cpu", "nvme"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- how a section checks itself

Rule = tuple[Callable[[Any], bool], str]  # (check, what the value must be)


def _at_least(n: int | float, note: str = "") -> Rule:
    return (lambda v: v >= n), f">= {n}" + (f" ({note})" if note else "")


def _above(n: int | float, note: str = "") -> Rule:
    return (lambda v: v > n), f"> {n}" + (f" ({note})" if note else "")


def _within(low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Rule:
    def ok(v: float) -> bool:
        return (low < v if open_low else low <= v) and (v < high if open_high else v <= high)

    return ok, f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"


def _check(section: Any, key: str, **rules: Rule) -> None:
    """Check `section`'s choice fields against their `Literal` and the named fields against `rules`;
    `key` is the section's dotted path ("" at the top), for the messages."""
    for name, tp in typing.get_type_hints(type(section)).items():
        _check_choice(getattr(section, name), tp, join(key, name))
    for name, (ok, must_be) in rules.items():
        value = getattr(section, name)
        if not ok(value):
            raise ConfigError(f"`{join(key, name)}` is {value!r}; it must be {must_be}")


def _check_choice(value: Any, tp: Any, key: str) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal and value not in args:
        raise ConfigError(f"`{key}` is {value!r}; choose one of: {', '.join(args)}")
    if origin in (typing.Union, types.UnionType):  # `X | None`
        (inner,) = [a for a in args if a is not type(None)]
        choices = typing.get_args(inner) if typing.get_origin(inner) is Literal else None
        if value is not None and choices is not None and value not in choices:
            raise ConfigError(f"`{key}` is {value!r}; choose one of: {', '.join(choices)} or null")
    if origin is list and typing.get_origin(args[0]) is Literal:
        choices = typing.get_args(args[0])
        for i, item in enumerate(value):
            if item not in choices:
                raise ConfigError(f"`{key}[{i}]` is {item!r}; choose from: {', '.join(choices)}")


# ---------------------------------------------------------------- the sections


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
    # what samplers receive: adapter (only the LoRA weights) | merged (full weights)
    sync: Literal["adapter", "merged"] = "adapter"

    def check(self, key: str = "model.lora") -> None:
        _check(self, key, r=_at_least(1), alpha=_above(0), dropout=_within(0, 1, open_high=True))


@dataclass
class ModelConfig:
    policy: str = "embedded"  # "embedded" | HF folder | hub id | path/to/model.gguf
    reference: str | None = None  # None = a frozen copy of the policy's initial weights
    reference_offload: bool = False  # load the reference for each batch's log-probs only (less peak memory)
    tokenizer: str | None = None  # None = the policy's
    dtype: Dtype = "float32"  # master weights
    trust_remote_code: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    lora: LoraSpec = field(default_factory=LoraSpec)

    def check(self, key: str = "model") -> None:
        _check(self, key)
        self.lora.check(f"{key}.lora")


@dataclass
class DataConfig:
    # "synthetic" | "gsm8k" (openai/gsm8k) | a .jsonl/.json/.csv/.parquet file | a folder (GSM8K
    # layout, or saved by `datasets`) | a hub data set id (needs a network)
    dataset: str = "synthetic"
    split: str = "train"
    num_examples: int = 2000  # synthetic: how many to generate; files: cap (0 = all)
    difficulty: int = 1  # synthetic data: 1 = one-step small numbers, 2 = up to two steps, numbers < 1000
    eval_dataset: str | None = None  # same forms as dataset; None = held-out synthetic / gsm8k test
    num_eval_examples: int = 200
    prompt_column: str = "prompt"  # a row's prompt: a string (continued as is) or chat messages
    # null = the task's own: rows built from a question (synthetic, GSM8K) get the math prompt, one
    # built-in shot and the "<think>" prefill; a row's own prompt gets none of them
    system_prompt: str | None = None
    shots: str | None = None  # a .jsonl of worked examples (or a built-in set: arithmetic, calculator)
    num_shots: int | None = None  # how many of the shots (null: all of data.shots, 1 built-in)
    prefill: str | None = None  # text the assistant turn starts with (part of the response)
    chat_template: str | None = None  # a Jinja file or template text instead of the tokenizer's
    shuffle: bool = True

    def check(self, key: str = "data") -> None:
        _check(
            self,
            key,
            num_examples=_at_least(0, "0 = all"),
            difficulty=(
                lambda v: v in (1, 2),
                "1 (one step, small numbers) or 2 (up to two steps, numbers < 1000)",
            ),
            num_eval_examples=_at_least(0),
            num_shots=(lambda v: v is None or v >= 0, ">= 0, or null (all shots given)"),
            prompt_column=(lambda v: isinstance(v, str) and v != "", "a column name"),
        )


_FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class RewardSpec:
    type: RewardType
    weight: float = 1.0
    function: str | None = None  # "package.module:function" when type == "function"
    path: str | None = None  # type model: a reward model folder written by `tandem rm` (its final/)
    name: str | None = None  # key in reward_info; default = type (or the function's name)
    # type function: `function` names a factory (or class), called once with these keyword arguments to
    # build the reward function, e.g. trl.rewards:get_soft_overlong_punishment; {} calls it with none.
    # type overlong (DAPO's soft overlong punishment, rewards/length.py): {cache: L_cache} and
    # optionally {max_length: L_max} (default sampling.max_new_tokens)
    kwargs: dict[str, Any] | None = None

    @property
    def resolved_name(self) -> str:
        """The key this reward gets in reward_info: `name`, else the function's name, else `type`."""
        if self.name:
            return self.name
        if self.type == "function" and self.function:
            return self.function.rpartition(":")[2]
        return self.type

    def check(self, key: str = "rewards[0]") -> None:
        """The rules of one spec (check_rewards adds those across specs); rewards/registry.py builds
        only specs that pass."""
        _check(self, key)
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ConfigError(f"`{key}.weight` is {weight!r}; it must be a finite number")
        if self.type == "function" and not (self.function and _FUNCTION_SPEC.match(self.function)):
            raise ConfigError(
                f"`{key}.function` is {self.function!r}; type function needs it as 'package.module:function'"
            )
        if self.type != "function" and self.function is not None:
            raise ConfigError(
                f"`{key}.function` is set but `{key}.type` is {self.type!r}; set type: function"
            )
        if self.kwargs is not None and self.type not in ("function", "overlong"):
            raise ConfigError(
                f"`{key}.kwargs` is set but `{key}.type` is {self.type!r}; kwargs build a reward "
                "function from a factory (type: function) or set the overlong reward's lengths"
            )
        if self.kwargs is not None and not all(isinstance(k, str) and k.isidentifier() for k in self.kwargs):
            raise ConfigError(
                f"`{key}.kwargs` has keys {sorted(map(str, self.kwargs))}; each must be a keyword "
                "argument name of the factory"
            )
        if self.type == "model" and not self.path:
            raise ConfigError(f"`{key}.path` is unset; type model needs the folder a `tandem rm` run wrote")
        if self.type != "model" and self.path is not None:
            raise ConfigError(f"`{key}.path` is set but `{key}.type` is {self.type!r}; set type: model")


OVERLONG_KWARGS = ("max_length", "cache")


def overlong_lengths(
    spec: RewardSpec, max_new_tokens: int | None, key: str = "rewards[0]"
) -> tuple[int, int]:
    """(max_length, cache) of a `type: overlong` spec: its kwargs, max_length defaulting to
    `max_new_tokens` (sampling.max_new_tokens); ConfigError naming the key when one is missing or
    out of range (cache in 1..max_length)."""
    kwargs = spec.kwargs or {}
    unknown = sorted(set(kwargs) - set(OVERLONG_KWARGS))
    if unknown:
        raise ConfigError(
            f"`{key}.kwargs` has {unknown}; type overlong takes {list(OVERLONG_KWARGS)}, e.g. "
            "kwargs: {max_length: 128, cache: 32}"
        )
    max_length = kwargs.get("max_length", max_new_tokens)
    if max_length is None:
        raise ConfigError(
            f"`{key}.kwargs.max_length` is unset and no sampling.max_new_tokens is known; set it (L_max)"
        )
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ConfigError(f"`{key}.kwargs.max_length` is {max_length!r}; it must be an integer >= 1 (L_max)")
    cache = kwargs.get("cache")
    if cache is None:
        raise ConfigError(
            f"`{key}.kwargs.cache` is unset; type overlong needs the soft buffer length L_cache, e.g. "
            f"kwargs: {{cache: {max(1, max_length // 4)}}} (the penalty falls from 0 to -1 over the last "
            "cache tokens before max_length)"
        )
    if isinstance(cache, bool) or not isinstance(cache, int) or not 1 <= cache <= max_length:
        raise ConfigError(
            f"`{key}.kwargs.cache` is {cache!r}; it must be an integer in 1..max_length ({max_length}): "
            f"lower it, or raise `{key}.kwargs.max_length`"
        )
    return max_length, cache


def check_rewards(rewards: Sequence[RewardSpec], max_new_tokens: int | None = None) -> None:
    """Every spec's rules, at least one spec, and distinct names (the keys of reward_info);
    `max_new_tokens` (sampling.max_new_tokens) is the overlong reward's default max_length."""
    if not rewards:
        raise ConfigError("`rewards` is empty; add at least one, e.g. rewards: [{type: answer}]")
    seen: set[str] = set()
    for i, spec in enumerate(rewards):
        key = f"rewards[{i}]"
        spec.check(key)
        if spec.type == "overlong":
            overlong_lengths(spec, max_new_tokens, key)
        if spec.resolved_name in seen:
            raise ConfigError(
                f"`{key}.name`: two rewards are named {spec.resolved_name!r}; give each a distinct name"
            )
        seen.add(spec.resolved_name)


@dataclass
class VLLMSpec:
    """`sampling.vllm`: the engine of `sampling.backend: vllm` (the sampler's own, in its process)."""

    gpu_memory_utilization: float = 0.7  # of the sampler's GPU; the rest holds the reference and rewards
    max_model_len: int = 0  # 0 = the longest prompt budget + sampling.max_new_tokens, at least 1024
    tensor_parallel_size: int = 1  # GPUs per engine (the sampler's devices); > 1 starts vLLM's workers
    enforce_eager: bool | None = (
        None  # None: true on the CPU (compiling costs more than it gains), false on GPUs
    )
    enable_prefix_caching: bool = True  # a group's prompt is computed once for its G completions
    cpu_kvcache_space_gib: float = 0.0  # CPU only: KV cache size; 0 = what batch_size x max_model_len needs
    # CPU only: the cores the engine's threads are bound to (vLLM's VLLM_CPU_OMP_THREADS_BIND):
    # auto = the last sampling.num_threads cores this process may use; or "0-3", "0,2", "nobind"
    cpu_threads_bind: str = "auto"
    # groups per batch scored again by the sampler's copy of the policy (same weights, the trainer's
    # forward): the engine's log-prob gap in every sampler row (engine_logprob_*); 0 = off
    check_groups: int = 1

    def check(self, key: str = "sampling.vllm") -> None:
        _check(
            self,
            key,
            check_groups=_at_least(0, "0 = off"),
            gpu_memory_utilization=_within(0, 1, open_low=True),
            max_model_len=_at_least(0, "0 = from the prompt budget and sampling.max_new_tokens"),
            tensor_parallel_size=_at_least(1),
            cpu_kvcache_space_gib=_at_least(0, "0 = sized from sampling.batch_size"),
        )
        bind = self.cpu_threads_bind
        if bind not in ("auto", "nobind") and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", bind):
            raise ConfigError(
                f"`{key}.cpu_threads_bind` is {bind!r}; use auto, nobind or a core list such as 0-3 or 0,2"
            )


@dataclass
class SamplingConfig:
    num_generations: int = 4  # G completions per prompt (group size)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    dtype: Dtype = "bfloat16"  # rollout copy of the policy
    batch_size: int = 32  # sequences per generation call
    num_threads: int = 0  # sampler process CPU threads, 0 = split the cores with the trainer
    # the sampler's generation engine: tandem (our batched loop; needs nothing more) or vllm (paged
    # attention, continuous batching, CUDA graphs, prefix caching; `pip install -e .[vllm]` on GPUs)
    backend: Literal["tandem", "vllm"] = "tandem"
    vllm: VLLMSpec = field(default_factory=VLLMSpec)

    def check(self, key: str = "sampling") -> None:
        self.vllm.check(f"{key}.vllm")
        _check(
            self,
            key,
            num_generations=_at_least(1),
            max_new_tokens=_at_least(1),
            temperature=_above(0),
            top_p=_within(0, 1, open_low=True),
            top_k=_at_least(0, "0 = off"),
            batch_size=_at_least(1),
            num_threads=_at_least(0, "0 = share the cores with the trainer"),
        )


@dataclass
class GRPOConfig:
    prompts_per_step: int = 8  # PPO too, unless ppo.prompts_per_step is set
    scale_rewards: Literal["group", "batch", "none"] = "group"
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.04
    num_iterations: int = 1  # optimizer passes over each step's batch
    adv_eps: float = 1e-4  # added to the std when scaling rewards
    skip_zero_variance_groups: bool = False
    # pi_old of the clipped ratio: the sampler's log-probs, or the trainer's own, recomputed at the
    # batch-start weights before the first update (another generation engine's log-probs differ)
    old_logprobs: Literal["sampler", "trainer"] = "sampler"
    # truncated importance weight min(pi_old / pi_sampler, importance_cap) on each token's surrogate
    # (Yao et al. 2025); needs old_logprobs=trainer
    importance_correction: bool = False
    importance_cap: float = 2.0
    # GSPO (Zheng et al. 2025): sequence = one importance ratio per completion, the geometric mean of its
    # token ratios, clipped as a whole (clip fractions then count sequences). The paper clips it far
    # tighter than token-level GRPO: clip_eps_low=3e-4, clip_eps_high=4e-4 (set them; the defaults stay 0.2)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # DAPO's overlong filtering (Yu et al. 2025): completions cut at sampling.max_new_tokens (no EOS) leave
    # the loss and its normalisers; their rewards still count in their group's advantages
    mask_truncated_completions: bool = False
    # DAPO's dynamic sampling (Yu et al. 2025): a group whose rewards all agree (no learning signal)
    # is not sent; its sampler makes a group of a fresh prompt instead, so every batch holds
    # prompts_per_step groups with reward variance. At most dynamic_sampling_max_extra_prompts such
    # extra prompts per batch (null: 3 x prompts_per_step); past the cap, groups are sent as they come.
    dynamic_sampling: bool = False
    dynamic_sampling_max_extra_prompts: int | None = None

    def check(self, key: str = "grpo") -> None:
        _check(
            self,
            key,
            prompts_per_step=_at_least(1),
            clip_eps_low=_at_least(0),
            clip_eps_high=_at_least(0),
            kl_coef=_at_least(0, "0 = no KL term"),
            num_iterations=_at_least(1),
            adv_eps=_at_least(0),
            importance_cap=_at_least(1),
            dynamic_sampling_max_extra_prompts=(
                lambda v: v is None or v >= 1,
                ">= 1 (null: 3 x prompts_per_step; dynamic_sampling: false turns it off)",
            ),
        )
        if self.importance_correction and self.old_logprobs == "sampler":
            raise ConfigError(
                f"`{key}.importance_correction` is true with {key}.old_logprobs=sampler, where pi_old is "
                f"the sampler's own log-probs and every weight is 1; set {key}.old_logprobs=trainer"
            )


@dataclass
class SFTConfig:
    """`tandem sft`: supervised fine-tuning on prompt/completion pairs or chat messages."""

    completion_only_loss: bool = True  # loss on completion tokens only (false: on every token)
    packing: bool = False  # several examples per row (block-diagonal attention) instead of padding
    max_length: int = 512  # tokens per example, prompt + completion; longer ones are cut from the end

    def check(self, key: str = "sft") -> None:
        _check(self, key, max_length=_at_least(2))


@dataclass
class RewardModelConfig:
    """`tandem rm`: a Bradley-Terry reward model (a scalar head on a causal LM); with task harmless a
    Safe-RLHF cost model where the data labels answers safe or unsafe."""

    task: PreferenceTask = "helpful"  # which built-in preference set data.dataset=synthetic gives
    max_length: int = 512  # tokens per prompt + answer
    # task harmless, labelled data: loss = pairwise + weight x cost_classification_loss (0: reported only)
    classification_loss_weight: float = 1.0

    def check(self, key: str = "rm") -> None:
        _check(self, key, max_length=_at_least(2), classification_loss_weight=_at_least(0))


@dataclass
class SafeMMConfig:
    """Safe-MM-DPO (algorithms/dpo.py): two frozen reward models score every pair once, then
    `lagrangian` (the authors': MM-DPO's margin-scaled beta on a helpful and a harmless loss, mixed by
    a Lagrange multiplier that follows the policy's expected cost) or `margin` (one DPO loss whose
    per-pair margin adds the weighted score gaps and a safety offset)."""

    helpful_model: str | None = (
        None  # a `tandem rm` folder (task helpful); None with harmless_model = plain DPO
    )
    harmless_model: str | None = None  # a `tandem rm` folder (task harmless): the cost model, C = -S
    variant: Literal["lagrangian", "margin"] = "lagrangian"
    # lagrangian (the origin's names: w, k, λ_init, λ_lr, cost_threshold; beta is dpo.beta = β_ori)
    w: float = 0.5  # beta(δ) = beta (1 + w (1 - exp(-k |δ|))): up to (1 + w) beta on sure pairs
    k: float = 0.5
    lambda_init: float = 1.0  # the Lagrange multiplier's start; L = (L_H + λ L_S) / (1 + λ)
    lambda_lr: float = 0.01  # ln λ += lambda_lr * λ * J_C after each optimizer step
    lambda_min: float = 1e-6
    lambda_max: float = 10.0
    cost_threshold: float = 0.0  # d in J_C = E[C] + d: λ falls once the expected cost is below -d
    cost_ema_decay: float = 0.95  # J_C is smoothed: ema = decay * ema + (1 - decay) * batch
    # margin: m = helpful_weight Δh + harmless_weight Δs + safety_margin 1[chosen safer]
    # (null: 1.0, 1.0, 0.0; set only with variant margin)
    helpful_weight: float | None = None
    harmless_weight: float | None = None
    safety_margin: float | None = None

    @property
    def enabled(self) -> bool:
        return self.helpful_model is not None or self.harmless_model is not None

    def check(self, key: str = "dpo.safe_mm") -> None:
        _check(
            self,
            key,
            w=_at_least(0),
            k=_at_least(0),
            lambda_min=_above(0),
            lambda_init=_above(0),
            lambda_lr=_at_least(0),
            cost_ema_decay=_within(0, 1, open_high=True),
        )
        if self.lambda_max < self.lambda_min:
            raise ConfigError(
                f"`{key}.lambda_max` is {self.lambda_max}, below lambda_min {self.lambda_min}; raise it"
            )
        if not self.lambda_min <= self.lambda_init <= self.lambda_max:
            raise ConfigError(
                f"`{key}.lambda_init` is {self.lambda_init}; it must lie in [lambda_min, lambda_max] = "
                f"[{self.lambda_min}, {self.lambda_max}]"
            )
        if not self.enabled or self.variant != "lagrangian":
            return
        margin_keys = [
            n for n in ("helpful_weight", "harmless_weight", "safety_margin") if getattr(self, n) is not None
        ]
        if margin_keys:
            raise ConfigError(
                f"`{key}.{margin_keys[0]}` is set but `{key}.variant` is lagrangian, which has no fixed "
                f"margin; set {key}.variant: margin to use it, or remove it"
            )
        for name in ("helpful_model", "harmless_model"):
            if getattr(self, name) is None:
                raise ConfigError(
                    f"`{key}.{name}` is unset; variant lagrangian needs both reward models (the helpful "
                    f"margins and the harmless model's costs): give the final/ folder of `tandem rm "
                    f"configs/rm_{name.split('_')[0]}.yaml`"
                )


@dataclass
class DPOConfig:
    """`tandem dpo`: direct preference optimisation against a frozen reference."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid (DPO) | ipo
    label_smoothing: float = 0.0  # conservative DPO: the chance a label is flipped
    # precompute (once, before training) | online (every batch)
    reference_logps: Literal["precompute", "online"] = "precompute"
    max_length: int = 512  # tokens per prompt + answer
    task: Literal[PreferenceTask, "mixed"] = "helpful"  # data.dataset=synthetic; mixed: Safe-MM-DPO
    safe_mm: SafeMMConfig = field(default_factory=SafeMMConfig)

    def check(self, key: str = "dpo") -> None:
        _check(
            self,
            key,
            max_length=_at_least(2),
            beta=_above(0),
            label_smoothing=_within(0, 0.5, open_high=True),
        )
        self.safe_mm.check(join(key, "safe_mm"))


@dataclass
class PPOConfig:
    """`tandem ppo`: PPO with a value head on the policy, on the GRPO sampler/trainer split."""

    # prompts per batch; None: grpo.prompts_per_step (PPO's key before it had its own)
    prompts_per_step: int | None = None
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    vf_coef: float = 0.1  # weight of the value loss
    value_learning_rate: float | None = (
        None  # the value head's own learning rate (None: training.learning_rate)
    )
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.05
    # reward: -kl_coef * KL per token in the reward | loss: a k3 KL term in the loss
    kl_mode: Literal["reward", "loss"] = "reward"
    whiten_advantages: bool = True
    num_iterations: int = 2  # optimizer passes over each batch (PPO epochs)

    def check(self, key: str = "ppo") -> None:
        _check(
            self,
            key,
            prompts_per_step=(lambda v: v is None or v >= 1, ">= 1, or null for grpo.prompts_per_step"),
            clip_eps=_at_least(0),
            value_clip_eps=_at_least(0),
            vf_coef=_at_least(0),
            value_learning_rate=(lambda v: v is None or v > 0, "> 0, or null for training.learning_rate"),
            gamma=_within(0, 1),
            lam=_within(0, 1),
            kl_coef=_at_least(0),
            num_iterations=_at_least(1),
        )


@dataclass
class TrainingConfig:
    max_steps: int = 200
    num_epochs: int = 1  # sft, rm, dpo: passes over the data (training stops at max_steps or here)
    eval_steps: int = 0  # sft, rm, dpo: evaluate every N steps (0 = at the end only)
    learning_rate: float = 1e-6
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
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
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = "no"
    max_grad_norm: float = 1.0  # 0 = no clipping
    # a step whose loss or gradient is NaN/inf is skipped (weights unchanged); this many in a row stop the run
    max_nonfinite_steps: int = 10
    gradient_checkpointing: bool = False
    save_steps: int = 50  # 0 = only the final save
    save_total_limit: int = 2  # 0 = keep all
    logging_steps: int = 1
    sample_log_steps: int = 10  # write completions to samples/ every N steps (0 = never)
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    resume_from_checkpoint: str | None = None  # "latest" | path to checkpoints/step-N
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int = 0  # torch CPU threads, 0 = torch default
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (false: full fp32, slower)
    # none: one process | ddp | deepspeed (ZeRO) | auto: < 1B parameters ddp, 1-7B ZeRO-2, > 7B ZeRO-3
    distributed_strategy: DistributedStrategy = "none"
    zero_stage: int = 2  # deepspeed: 1 (optimizer states) | 2 (+ gradients) | 3 (+ parameters) sharded
    offload_optimizer: OffloadDevice = "none"  # deepspeed: optimizer states off the GPU
    offload_param: OffloadDevice = "none"  # deepspeed ZeRO-3: parameters off the GPU
    # ZeRO-3: load the policy (and DPO's reference) under deepspeed.zero.Init, each rank holding only
    # its shard from the start; false: every rank loads the whole model, then DeepSpeed shards it
    # (for model code that zero.Init cannot build, or to compare with that path)
    zero3_init: bool = True
    nvme_path: str | None = None  # folder for nvme offload
    deepspeed_config: str | None = None  # a DeepSpeed JSON ("auto" values are filled from this config)
    dist_backend: DistBackend = "auto"  # auto: nccl on GPUs, gloo on the CPU
    # bf16 under DeepSpeed: autocast (fp32 parameters, forward under torch.autocast, fp32 gradient
    # reduction: computes as DDP does; ZeRO-1/2 hold 4 bytes per parameter replicated instead of 2)
    # | native (DeepSpeed's bf16 mode: bf16 parameters, fp32 master copy; less memory, other rounding)
    deepspeed_bf16: Literal["autocast", "native"] = "autocast"
    # DistributedDataParallel options (strategy ddp), under the names HF TrainingArguments uses
    ddp_find_unused_parameters: bool = False  # true for models whose forward skips some parameters
    ddp_bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size
    ddp_broadcast_buffers: bool = True  # broadcast module buffers from rank 0 at every forward
    # a collective waits this long for a slow rank (rank 0 saving); waiting for samplers never counts
    dist_timeout_s: float = 1800.0

    def check(self, key: str = "training") -> None:
        _check(
            self,
            key,
            max_steps=_at_least(1),
            num_epochs=_at_least(1),
            eval_steps=_at_least(0, "0 = at the end only"),
            learning_rate=_above(0),
            warmup_steps=_at_least(0),
            dist_timeout_s=_at_least(1, "seconds"),
            min_lr_ratio=_within(0, 1),
            weight_decay=_at_least(0),
            adam_beta1=_within(0, 1, open_high=True),
            adam_beta2=_within(0, 1, open_high=True),
            adam_eps=_above(0),
            micro_batch_size=_at_least(1),
            gradient_accumulation_steps=_at_least(1),
            max_grad_norm=_at_least(0, "0 = no clipping"),
            max_nonfinite_steps=_at_least(1),
            save_steps=_at_least(0, "0 = only the final save"),
            save_total_limit=_at_least(0, "0 = keep all"),
            logging_steps=_at_least(1),
            sample_log_steps=_at_least(0, "0 = never"),
            num_threads=_at_least(0, "0 = torch default"),
            ddp_bucket_cap_mb=_above(0, "megabytes"),
            zero_stage=(lambda v: v in (1, 2, 3), "1, 2 or 3"),
        )
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"`{key}.device` is {self.device!r}; use auto, cpu, cuda or cuda:N")
        deepspeed_only = {
            "zero_stage": self.zero_stage != 2,
            "offload_optimizer": self.offload_optimizer != "none",
            "offload_param": self.offload_param != "none",
            "deepspeed_config": self.deepspeed_config is not None,
        }
        if self.distributed_strategy in ("none", "ddp"):
            for name, is_set in deepspeed_only.items():
                if is_set:
                    raise ConfigError(
                        f"`{key}.{name}` is set but `{key}.distributed_strategy` is "
                        f"{self.distributed_strategy!r}; it applies to DeepSpeed: set {key}.distributed_strategy=deepspeed"
                    )
        if self.offload_param != "none" and self.zero_stage != 3 and self.distributed_strategy == "deepspeed":
            raise ConfigError(
                f"`{key}.offload_param` is {self.offload_param!r} with {key}.zero_stage={self.zero_stage}; "
                f"parameters are sharded (and offloaded) only by ZeRO-3: set {key}.zero_stage=3"
            )
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ConfigError(f"`{key}.nvme_path` is unset; NVMe offload needs a folder on a fast local disk")


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

    def check(self, key: str = "pipeline.curve") -> None:
        trainer = self.server_secret_key, self.authorized_clients
        sampler = self.server_public_key, self.client_secret_key
        if (None in trainer and any(trainer)) or (None in sampler and any(sampler)):
            raise ConfigError(
                f"`{key}` is half set: the trainer needs server_secret_key and authorized_clients, "
                "a sampler needs server_public_key and client_secret_key (make them with `tandem keygen DIR`)"
            )


_PORT: Rule = (lambda v: 0 < v < 65536), "a TCP port in 1..65535"


@dataclass
class PipelineConfig:
    """The decoupled sampler/trainer pipeline (DESIGN.md sections 1-4)."""

    # decoupled: sampler and trainer processes | colocated: one process
    mode: Literal["decoupled", "colocated"] = "decoupled"
    num_samplers: int = 1  # samplers that `tandem grpo` starts / that share the work of a version
    trainer_host: str = "127.0.0.1"  # where samplers find the trainer
    bind_host: str = "*"  # the interface the trainer binds ("*" = all)
    data_port: int = 5555  # groups, sampler PUSH -> trainer PULL
    sync_port: int = 5556  # weights and status, trainer ROUTER <-> sampler DEALER
    sync_method: Literal["zmq", "fs"] = "zmq"  # zmq (from memory) | fs (files in sync_dir)
    sync_dir: str | None = None  # fs method; None = <run_dir>/weights
    sync_every: int = 1  # publish new weights every N optimizer steps (the seed's gen_update_steps)
    sync_dtype: Dtype | None = None  # dtype the weights travel in; None = the trainer's
    sync_keep_versions: int = 2  # fs method: versions kept on disk
    max_staleness: int = 1  # drop groups more than N versions old (0 = strictly on-policy)
    send_hwm: int = 4  # groups queued in a sampler before it blocks
    recv_hwm: int = 4  # groups queued per sampler in the trainer before senders block
    max_message_mb: int = 64  # ZMQ_MAXMSGSIZE of the data channel
    data_warn_s: float = 60.0  # trainer: say so when no group arrived for this long
    data_timeout_s: float = 0.0  # trainer: give up after this long without a group (0 = never)
    trainer_timeout_s: float = 0.0  # sampler: give up after this long without the trainer (0 = never)
    curve: CurveConfig = field(default_factory=CurveConfig)

    def check(self, key: str = "pipeline") -> None:
        _check(
            self,
            key,
            num_samplers=_at_least(1),
            data_port=_PORT,
            sync_port=_PORT,
            sync_every=_at_least(1),
            sync_keep_versions=_at_least(1),
            max_staleness=_at_least(0, "0 = strictly on-policy"),
            send_hwm=_at_least(1),
            recv_hwm=_at_least(1),
            max_message_mb=_at_least(1),
            data_warn_s=_above(0),
            data_timeout_s=_at_least(0, "0 = wait forever"),
            trainer_timeout_s=_at_least(0, "0 = wait forever"),
        )
        if self.data_port == self.sync_port:
            raise ConfigError(
                f"`{key}.sync_port` equals `{key}.data_port` ({self.data_port}); give the two channels "
                "different ports (default 5555 and 5556)"
            )
        self.curve.check(f"{key}.curve")


@dataclass
class AgentConfig:
    """Agentic RL: multi-turn episodes with tools (sampler/episodes.py). Off while both tools and
    environment are unset: then a rollout is one completion per prompt, as always."""

    # TRL tool functions by import path ("pkg.mod:function"): schema from signature and docstring
    tools: list[str] = field(default_factory=list)
    # a TRL environment_factory class ("pkg.mod:Class"): one instance per episode, reset(**row),
    # its public methods are tools, get_reward() (when defined) scores the finished episode
    environment: str | None = None
    max_turns: int = 4  # assistant turns per episode (the last one gets no tool results)
    # the episode's tokens after the prompt (the policy's and the tools'); null: max_new_tokens x max_turns
    max_episode_tokens: int | None = None
    tool_timeout_s: float = 10.0  # per call; a call past it answers with an error
    max_tool_response_tokens: int = 256  # a tool result is cut to this many tokens
    # how tool calls are read: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>),
    # template (the tokenizer's response_template, transformers' parse_response), auto (template
    # where the tokenizer has one, else hermes)
    tool_call_format: Literal["auto", "hermes", "template"] = "auto"
    max_tool_workers: int = 8  # threads for sync tools, shared by a batch's episodes

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The longest episode after the prompt, with `max_new_tokens` per turn."""
        return self.max_episode_tokens or max_new_tokens * self.max_turns

    def check(self, key: str = "agent") -> None:
        _check(
            self,
            key,
            max_turns=_at_least(1),
            max_episode_tokens=(lambda v: v is None or v >= 1, ">= 1 (null: max_new_tokens x max_turns)"),
            tool_timeout_s=_above(0),
            max_tool_response_tokens=_at_least(1),
            max_tool_workers=_at_least(1),
        )


@dataclass
class EvalConfig:
    """`eval`: held-out evaluation during a GRPO/PPO run, every `steps` policy versions (0 = off) and
    once before training, with the run's own rewards as the scorers (sampler/evaluation.py).
    Colocated: the trainer evaluates between steps; decoupled: the sampler `sampler_id` evaluates
    the versions it loads and sends the figures to the trainer, which logs them."""

    steps: int = 0
    dataset: str | None = None  # same forms as data.dataset; null = data.dataset's `split` below
    split: str = "test"
    num_examples: int = 100  # the first N rows (synthetic: N held-out problems)
    num_samples: int = 1  # k completions per prompt: pass@k and mean@k
    temperature: float | None = None  # null: greedy (0) for one sample, sampling.temperature for k > 1
    max_new_tokens: int | None = None  # null: sampling.max_new_tokens
    # the reward whose positive value means "correct" (accuracy, pass@k); null: `answer` if the run
    # has it, else the first reward
    correct_reward: str | None = None
    sampler_id: str = (
        "s0"  # decoupled: the sampler that evaluates (tandem grpo/launch name theirs s0, s1, ...)
    )

    def check(self, key: str = "eval") -> None:
        _check(
            self,
            key,
            steps=_at_least(0, "0 = off"),
            num_examples=_at_least(1),
            num_samples=_at_least(1),
            temperature=(lambda v: v is None or v >= 0, ">= 0 (0 = greedy), or null"),
            max_new_tokens=(lambda v: v is None or v >= 1, ">= 1, or null"),
        )
        if self.num_samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"`{key}.num_samples` is {self.num_samples} with {key}.temperature 0: greedy decoding "
                f"gives k equal samples; set {key}.temperature > 0 (or null: sampling.temperature)"
            )


@dataclass
class Config:
    method: Method = "grpo"  # the command that runs this config
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.experiment_name

    @property
    def prompts_per_step(self) -> int:
        """Prompts per batch of this run's method: PPO's `ppo.prompts_per_step` when set, else (and
        for every other method) `grpo.prompts_per_step`."""
        return self.ppo.prompts_per_step if self._ppo_own_prompts else self.grpo.prompts_per_step

    @property
    def completion_tokens(self) -> tuple[int, str]:
        """The longest completion a group may carry and the setting that says so: an agent run's
        is its whole episode (turns and tool results), else sampling.max_new_tokens."""
        if not self.agent.enabled:
            return self.sampling.max_new_tokens, "sampling.max_new_tokens"
        key = (
            "agent.max_episode_tokens"
            if self.agent.max_episode_tokens
            else "sampling.max_new_tokens x agent.max_turns"
        )
        return self.agent.episode_tokens(self.sampling.max_new_tokens), key

    @property
    def prompts_per_step_key(self) -> str:
        """The dotted key `prompts_per_step` comes from, for messages."""
        return "ppo.prompts_per_step" if self._ppo_own_prompts else "grpo.prompts_per_step"

    @property
    def _ppo_own_prompts(self) -> bool:
        return self.method == "ppo" and self.ppo.prompts_per_step is not None

    def check(self) -> None:
        """Every section's rules and the rules across sections; raises ConfigError naming the key and
        the fix."""
        name = self.experiment_name
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ConfigError(
                f"`experiment_name` is {name!r}; use a plain folder name without '/' (e.g. gsm8k-grpo)"
            )
        _check(self, "", seed=(lambda v: 0 <= v < 2**32, "in [0, 2**32)"))
        sections = (self.model, self.data, self.sampling, self.grpo, self.sft, self.rm, self.dpo, self.ppo)
        for section in (*sections, self.training, self.pipeline, self.eval, self.agent):
            section.check()
        if self.agent.enabled:
            _check_agent(self)
        if self.method == "grpo" and self.sampling.num_generations < 2:
            raise ConfigError(
                f"`sampling.num_generations` is {self.sampling.num_generations}; GRPO needs >= 2 "
                "(a group of one completion has no advantage)"
            )
        if self.method == "ppo":
            _check_ppo_prompts(self)
            _check_grpo_only(self)
        if self.sampling.backend == "vllm" and self.pipeline.mode != "decoupled":
            raise ConfigError(
                "`sampling.backend` is vllm with pipeline.mode=colocated; the vLLM engine runs in the "
                "sampler process: set pipeline.mode=decoupled (`tandem grpo` then starts a sampler and a "
                "trainer) or sampling.backend=tandem"
            )
        if self.method in ("grpo", "ppo"):
            check_rewards(self.rewards, self.sampling.max_new_tokens)
            validate_batch(self)
            names = [spec.resolved_name for spec in self.rewards]
            if self.eval.correct_reward is not None and self.eval.correct_reward not in names:
                raise ConfigError(
                    f"`eval.correct_reward` is {self.eval.correct_reward!r}; the run's rewards are "
                    f"{', '.join(names)}: name one of them (or null: answer, else the first)"
                )
        if self.method == "dpo" and self.dpo.safe_mm.enabled and self.dpo.loss_type != "sigmoid":
            raise ConfigError(
                "`dpo.safe_mm` is set with dpo.loss_type=ipo; Safe-MM-DPO is defined for the "
                "sigmoid loss: set dpo.loss_type=sigmoid"
            )
        safe_mm = self.dpo.safe_mm
        lagrangian = self.method == "dpo" and safe_mm.enabled and safe_mm.variant == "lagrangian"
        if lagrangian and self.dpo.label_smoothing:
            raise ConfigError(
                f"`dpo.label_smoothing` is {self.dpo.label_smoothing} with dpo.safe_mm.variant="
                "lagrangian, whose two losses have no smoothing: set it to 0 (or variant margin)"
            )


def _check_ppo_prompts(cfg: Config) -> None:
    """PPO read `grpo.prompts_per_step` before it had `ppo.prompts_per_step`; the old key still works,
    and counts as unset at its default. Two different numbers are refused rather than one chosen."""
    own, old = cfg.ppo.prompts_per_step, cfg.grpo.prompts_per_step
    if own is not None and old not in (own, GRPOConfig.prompts_per_step):
        raise ConfigError(
            f"`ppo.prompts_per_step` is {own} and `grpo.prompts_per_step` is {old}; PPO reads "
            "ppo.prompts_per_step (grpo.prompts_per_step is its older name): drop grpo.prompts_per_step "
            "or set both to the same number"
        )


def _check_agent(cfg: Config) -> None:
    """What agent runs do not support yet, refused with the reason rather than run half-right."""
    if cfg.method != "grpo":
        raise ConfigError(f"`agent` is set for method {cfg.method}; multi-turn episodes train with GRPO only")


def _check_grpo_only(cfg: Config) -> None:
    """GRPO's loss variants that PPO's loss does not have: refused rather than ignored."""
    variants = (
        ("importance_sampling_level", "token"),
        ("mask_truncated_completions", False),
        ("dynamic_sampling", False),
    )
    for name, default in variants:
        value = getattr(cfg.grpo, name)
        if value != default:
            raise ConfigError(
                f"`grpo.{name}` is {value!r} but `tandem ppo` trains with PPO's own loss, which does not "
                f"read it; drop it (or set it to {default!r}), or run `tandem grpo`"
            )


def validate(cfg: Config) -> None:
    """Check a converted Config (`cfg.check()`); raises ConfigError naming the key and the fix."""
    cfg.check()


def validate_batch(cfg: Config, world_size: int = 1) -> None:
    """One optimizer step consumes micro_batch_size x gradient_accumulation_steps x world_size
    sequences (DeepSpeed's train_batch_size); that must divide what one step samples."""
    prompts, group = cfg.prompts_per_step, cfg.sampling.num_generations
    prompts_key = cfg.prompts_per_step_key
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
        fix = f"make {prompts_key} * sampling.num_generations a multiple of the {world_size} ranks"
    raise ConfigError(
        f"`training.gradient_accumulation_steps`: one step samples {prompts_key} * "
        f"sampling.num_generations = {prompts} * {group} = {num_sequences} sequences, but one optimizer step "
        f"consumes training.micro_batch_size * training.gradient_accumulation_steps{ranks} = "
        f"{micro} * {accum}{ranks} = {micro * accum * world_size}, which does not divide {num_sequences}; {fix}"
    )


# ---------------------------------------------------------------- load, dump

T = TypeVar("T")


def config_from_dict(d: dict[str, Any], cls: type[T] = Config) -> T:  # type: ignore[assignment]
    """Build `cls` from a nested dict, checking every key and type against the dataclass hints."""
    return from_dict(d, cls)


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, method: str | None = None
) -> Config:
    """Read a YAML file (None = all defaults), apply overrides, convert and validate.

    `method` is the command's (`tandem sft` passes "sft"): a file written for another method is
    refused rather than trained with the wrong loop."""
    raw: Any = {}
    if path is not None:
        path = Path(path)
        raw = read_yaml(path)
    from tandem.config_aliases import read_seed_keys, read_seed_overrides

    # seed/HF key names (config_aliases.py): the file's first, then the overrides', which win (a
    # name may mean different keys per method, `beta`: they see the command's method)
    raw, notes = read_seed_keys(raw, method)
    overrides, override_notes = read_seed_overrides(list(overrides), apply_overrides(raw, overrides), method)
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
