"""LoRA through PEFT: which modules get adapters, what travels to samplers, and the reference that
is the base model itself.

With `model.lora.enabled` the policy is the frozen base plus low-rank adapters (only those train
and only those have optimizer state). The KL reference is the same model with its adapters
switched off (`BaseOfAdapter`), so no second copy of the weights is loaded. Samplers receive
either the adapters alone (`sync: adapter`, megabytes instead of the whole model; the sampler's
own base plus adapters reproduces the policy exactly) or merged full weights (`sync: merged`, for
a sampler that runs a plain model; its reference is then a separate copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tandem.config import ConfigError, LoraSpec

ADAPTER = "default"


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Wrap `model` with fresh adapters (B = 0: the wrapped model computes exactly the base).

    A reward model (`*ForSequenceClassification`) gets PEFT's SEQ_CLS task: its new scalar head
    (`score`) trains in full next to the adapters and is saved with them."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError(
            "`model.lora.enabled` needs PEFT: pip install 'tandem[lora]' (or pip install peft)"
        ) from None

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    if head_name and any(head_name == t or head_name.endswith("." + t) for t in spec.target_modules):
        raise ConfigError(
            f"`model.lora.target_modules` includes the output projection ({head_name}); tandem scores "
            "tokens with its weight directly, so an adapter there would never train: remove it"
        )
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".lora_" in name}


def base_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.q_proj.base_layer.weight` -> `model.layers.0.q_proj.weight`."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@torch.no_grad()
def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy as plain full weights, named as in the base model (W + scale * B @ A)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(ADAPTER)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        yield base_name(name), (p + deltas[name].to(p.dtype)) if name in deltas else p


def sync_tensors(model: torch.nn.Module, mode: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer publishes: all parameters, or (LoRA) the adapters or merged weights."""
    if not is_lora(model):
        return iter(model.named_parameters())
    if mode == "merged":
        return merged_tensors(model)
    return iter(adapter_parameters(model).items())


class BaseOfAdapter:
    """The frozen reference of a LoRA run: the policy with its adapters off, used in a `with`
    block (the same parameters, no second copy)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> torch.nn.Module:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self.model.disable_adapter())
        return self.model

    def __exit__(self, *exc_info) -> None:
        assert self._stack is not None
        self._stack.close()
