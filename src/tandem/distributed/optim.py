"""AdamW with decoupled weight decay on matrices only, and warmup + constant/linear/cosine schedules."""

from __future__ import annotations

import math

import torch

from tandem.config import TrainingConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters. A module with `learning_rates` ({name prefix: lr}, e.g.
    PPO's value head) gives those parameters their own base learning rate; the schedule scales
    every group alike."""
    special = getattr(model, "learning_rates", {})
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            lr = next((lr for prefix, lr in special.items() if name.startswith(prefix)), cfg.learning_rate)
            # norms and biases are vectors; decaying them only fights the normalisation
            groups.setdefault((lr, param.ndim >= 2), []).append(param)
    return torch.optim.AdamW(
        [
            {"params": params, "lr": lr, "weight_decay": cfg.weight_decay if decay else 0.0}
            for (lr, decay), params in sorted(
                groups.items(), key=lambda kv: (kv[0][0] != cfg.learning_rate, not kv[0][1])
            )
        ],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        # fused: one kernel per step, no foreach temporaries the size of the model (peak memory)
        fused=True,
    )


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of learning_rate at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_scheduler == "linear":
        shape = 1.0 - progress
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
