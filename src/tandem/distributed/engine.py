"""The narrow engine the training loops drive, the same for every strategy.

    engine = build_engine(model, cfg.training, env, device)
    for i, micro in enumerate(micro_batches):
        with engine.accumulate(last=i == len(micro_batches) - 1):
            logprobs = engine.model(packed_rows)     # the policy's token log-probs (forward.py)
            loss = loss_of(logprobs, micro)          # divided by the GLOBAL count of the batch
            engine.backward(loss)
    grad_norm = engine.step()                       # clip, optimizer, lr schedule (or a skip)
    with engine.gathered():                         # full parameters in engine.module (all ranks)
        ...                                         # rank 0: publish weights, export

Contract: gradients are SUMMED over ranks (`backward` multiplies by the world size what DDP and
DeepSpeed average), so a loss normalised by global counts gives the same update at any world
size. Every rank must run the same number of `accumulate` blocks per step (the trainer pads a
short share with zero-weighted micro-batches): DDP and ZeRO reduce inside backward, and ZeRO-3
gathers parameters inside forward.

`TorchEngine` serves `none` and `ddp`; `DeepSpeedEngine` serves ZeRO-1/2/3 (with CPU/NVMe
offload); under ZeRO-3 the policy comes to it already sharded (loaded inside `partitioned_loading`).
A step whose gradient norm is NaN or inf (a non-finite loss, an overflow) is skipped the way loss
scalers skip: no optimizer or schedule step, gradients dropped, `engine.last_step_skipped` set. The
gradient norm is the same on every rank after the reduction, so all ranks skip together.
`training.max_nonfinite_steps` skips in a row raise `NonFiniteSteps` naming the step: a diverged run
stops with its last finite weights rather than saving NaN.

Only this package imports torch.distributed or deepspeed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tandem.config import ConfigError, TrainingConfig
from tandem.distributed import deepspeed_config
from tandem.distributed.env import DistEnv, barrier
from tandem.distributed.optim import build_optimizer, build_scheduler
from tandem.distributed.runtime import grad_scaler, trim_memory
from tandem.models.forward import PackedLogprobsModule

log = logging.getLogger(__name__)


class NonFiniteSteps(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient; the weights are those before them."""


class SkipCount:
    """The steps an engine has taken and skipped. `steps_done` is the run's step count (a resumed
    run's checkpoint sets it), so a message names the step the metrics row will carry."""

    def __init__(self, limit: int):
        self.limit, self.steps_done, self.skipped, self.in_a_row = limit, 0, 0, 0
        self.last_skipped = False

    def nothing_to_learn(self) -> None:
        """A step with no data to train on (GRPO: every group had zero reward variance) still counts."""
        self.steps_done += 1
        self.last_skipped = False

    def record(self, grad_norm: float, applied: bool) -> None:
        self.steps_done += 1
        self.last_skipped = not applied
        if applied:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        log.warning(
            "step %d: gradient norm %s is not finite; the step is skipped and the weights stay as they "
            "were (%d in a row, the run stops at training.max_nonfinite_steps=%d)",
            self.steps_done,
            grad_norm,
            self.in_a_row,
            self.limit,
        )
        if self.in_a_row >= self.limit:
            raise NonFiniteSteps(
                f"step {self.steps_done}: {self.in_a_row} optimizer steps in a row had a non-finite loss "
                f"or gradient (last gradient norm {grad_norm}); stopping with the weights of step "
                f"{self.steps_done - self.in_a_row}. Look for a diverging learning rate or non-finite "
                "rewards/advantages; training.max_nonfinite_steps sets how many skips are tolerated"
            )


class TorchEngine:
    """Plain PyTorch (`none`) or DistributedDataParallel (`ddp`); checkpoints in PyTorch format."""

    format = "torch"
    shards_parameters = False  # every rank holds the whole model

    def __init__(
        self,
        module: torch.nn.Module,
        tc: TrainingConfig,
        env: DistEnv,
        device: torch.device,
        forward: torch.nn.Module | None = None,
    ):
        self.module, self.env, self.tc = module, env, tc
        self.optimizer = build_optimizer(forward if forward is not None else module, tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.scaler = grad_scaler(device, tc.mixed_precision)
        self.skips = SkipCount(tc.max_nonfinite_steps)
        self.model: torch.nn.Module = forward if forward is not None else PackedLogprobsModule(module)
        if env.active:
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(
                self.model,
                device_ids=ids,
                find_unused_parameters=tc.ddp_find_unused_parameters,
                bucket_cap_mb=tc.ddp_bucket_cap_mb,
                broadcast_buffers=tc.ddp_broadcast_buffers,
            )

    def accumulate(self, *, last: bool):
        """DDP all-reduces only in the last micro-batch's backward."""
        if self.env.active and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss * self.env.world_size
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        trim_memory()  # this micro-batch's activations are free now

    def step(self) -> float:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.tc.max_grad_norm if self.tc.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        applied = math.isfinite(grad_norm)
        if applied:  # a fp16 scaler that found inf/NaN would skip as well; it only lowers its scale
            if self.scaler:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self.scheduler.step()
        if self.scaler:
            self.scaler.update()
        # free the gradients now, not at the next zero_grad: the next batch's generation then
        # runs without a model-sized buffer held (peak memory)
        self.optimizer.zero_grad(set_to_none=True)
        trim_memory()
        self.skips.record(grad_norm, applied)
        return grad_norm

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def gathered(self):
        return contextlib.nullcontext()

    def save(self, folder: Path) -> None:
        """Optimizer and scheduler state (identical on every rank); the caller writes the model."""
        if self.env.is_main:
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
            if self.scaler is not None:  # fp16: the loss scale it has found, not 2**16 again
                torch.save(self.scaler.state_dict(), folder / "scaler.pt")

    def load(self, folder: Path) -> None:
        if not (folder / "optimizer.pt").is_file():
            raise ConfigError(
                f"{folder} is a {checkpoint_format(folder)} checkpoint; resume it with "
                "training.distributed_strategy=deepspeed, or start a new run from its weights "
                f"with model.policy={folder / 'model'}"
            )
        # onto this rank's own device: without map_location every rank would first put the state
        # where it was saved (rank 0's GPU) and fill that GPU N times over
        device = next(self.module.parameters()).device
        self.optimizer.load_state_dict(
            torch.load(folder / "optimizer.pt", map_location=device, weights_only=True)
        )
        self.scheduler.load_state_dict(
            torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True)
        )
        if self.scaler is not None and (folder / "scaler.pt").is_file():
            self.scaler.load_state_dict(
                torch.load(folder / "scaler.pt", map_location="cpu", weights_only=True)
            )


class DeepSpeedEngine:
    """DeepSpeed ZeRO stage 1/2/3; checkpoints in DeepSpeed's sharded format (plus an HF model)."""

    format = "deepspeed"

    def __init__(
        self,
        module: torch.nn.Module,
        tc: TrainingConfig,
        env: DistEnv,
        device: torch.device,
        stage: int,
        forward: torch.nn.Module | None = None,
    ):
        import deepspeed

        self.env, self.tc = env, tc
        config = deepspeed_config.resolve(tc, env.world_size, stage, hidden_size(module))
        self.stage = int(config["zero_optimization"]["stage"])
        self.shards_parameters = self.stage == 3  # no rank holds the whole model outside gathered()
        if env.is_main and tc.mixed_precision == "bf16":
            autocast = config.get("torch_autocast", {}).get("enabled", False)
            log.info(
                "bf16 under DeepSpeed: %s",
                "fp32 parameters with torch.autocast, as DDP computes (training.deepspeed_bf16=native: "
                "DeepSpeed's bf16 parameters, half the parameter memory below ZeRO-3)"
                if autocast
                else "DeepSpeed's bf16 mode (bf16 parameters, fp32 master copy)",
            )
        trained = forward if forward is not None else module
        optimizer = None if "optimizer" in config else build_optimizer(trained, tc)
        scheduler = None if "scheduler" in config or optimizer is None else build_scheduler(optimizer, tc)
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=forward if forward is not None else PackedLogprobsModule(module),
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
        )
        self.module = module
        self.config = config
        self.skips = SkipCount(tc.max_nonfinite_steps)

    def accumulate(self, *, last: bool):
        self.model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss * self.env.world_size, scale_wrt_gas=False)
        trim_memory()

    def step(self) -> float:
        """DeepSpeed itself skips a step with a non-finite gradient norm (ZeRO-1/2 in fp32 and bf16,
        ZeRO-3 always, any stage's fp16 loss scaler) and counts it in `skipped_steps`."""
        skipped_before = self.model.skipped_steps
        self.model.step()
        trim_memory()
        applied = self.model.skipped_steps == skipped_before
        norm = self.model.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else 0.0
        self.skips.record(grad_norm if applied else float("nan"), applied)
        return grad_norm if applied else float("nan")

    def lr(self) -> float:
        return float(self.model.get_lr()[0])

    def gathered(self):
        """Under ZeRO-3 every rank takes part in gathering the full parameters into the module, and
        into any head that trains with it (PPO's value head, sharded too below DeepSpeed's
        stage3_param_persistence_threshold)."""
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.module.parameters()), modifier_rank=None)

    def save(self, folder: Path) -> None:
        """Every rank writes its shards into folder/deepspeed (a folder all ranks see)."""
        self.model.save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)

    def load(self, folder: Path) -> None:
        if not (folder / "deepspeed").is_dir():
            raise ConfigError(
                f"{folder} is a {checkpoint_format(folder)} checkpoint, not DeepSpeed's; resume it with "
                "training.distributed_strategy=none or ddp, or start a new run from its weights with "
                f"model.policy={folder / 'model'}"
            )
        path, _ = self.model.load_checkpoint(
            str(folder / "deepspeed"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise ValueError(f"DeepSpeed found no checkpoint in {folder / 'deepspeed'}")


@contextlib.contextmanager
def partitioned_loading(
    tc: TrainingConfig,
    env: DistEnv,
    dtype: str,
    num_parameters: Callable[[], int],
    hidden_size: int | None = None,
) -> Iterator[bool]:
    """Under ZeRO-3, `from_pretrained` inside this block builds the model under deepspeed.zero.Init:
    each rank allocates only its shard of every parameter and rank 0 reads the checkpoint, handing
    each layer's values out as it goes, so no rank holds the whole model before DeepSpeed shards it.
    Yields whether it does (see deepspeed_config.zero3_init_config). The load is collective: every
    rank enters the block at once."""
    config = deepspeed_config.zero3_init_config(tc, env.world_size, dtype, num_parameters, hidden_size)
    if config is None:
        yield False
        return
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed.init_distributed(dist_backend=env.backend)  # zero.Init takes the world size from it
    # transformers finds it through a weak reference. Alive for this block only: loads outside it
    # (Safe-MM's reward models) stay whole, and training meets none of transformers' ZeRO-3 paths
    hf_config = HfDeepSpeedConfig(config)
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def frozen_forward(module: torch.nn.Module, tc: TrainingConfig, env: DistEnv) -> torch.nn.Module:
    """forward(packed rows, temperature) -> token log-probs of a frozen model that runs beside the
    trained one (DPO's reference); call it without gradients. A model loaded sharded runs inside a
    DeepSpeed engine without optimizer, whose hooks gather each layer for its forward (as TRL does
    for its reference): every rank must then call it as many times as the others."""
    forward = PackedLogprobsModule(module)
    if not is_partitioned(module):
        return forward
    import deepspeed

    config = deepspeed_config.resolve(tc, env.world_size, 3, hidden_size(module))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=forward, config=config)
    engine.eval()  # DeepSpeed's eval() returns None, not the engine
    return engine


def hidden_size(module: torch.nn.Module) -> int | None:
    """The model's hidden size (DeepSpeed's "auto" bucket sizes follow it), None if it has none."""
    config = getattr(module, "config", None)
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether `module` holds ZeRO-3 shards (built under partitioned_loading, or already trained)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def checkpoint_format(folder: Path) -> str:
    return "deepspeed" if (folder / "deepspeed").is_dir() else "torch"


def build_engine(
    module: torch.nn.Module,
    tc: TrainingConfig,
    env: DistEnv,
    device: torch.device,
    forward: torch.nn.Module | None = None,
) -> TorchEngine | DeepSpeedEngine:
    """The engine for tc.distributed_strategy. `forward` is the nn.Module the loop calls as
    engine.model: it owns `module` as a submodule plus any head that trains with it (a value
    head), and the optimizer takes its parameters; engine.module stays the model that checkpoints,
    exports and weight sync see. By default PackedLogprobsModule(module), the policy's token
    log-probs."""
    # a ZeRO-3 shard counts whole
    num_parameters = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    strategy, stage = deepspeed_config.strategy_for(num_parameters, tc.distributed_strategy, tc.zero_stage)
    if is_partitioned(module):  # loaded under partitioned_loading: ZeRO-3 was decided there
        strategy, stage = "deepspeed", 3
    if tc.distributed_strategy == "auto" and env.is_main:
        chosen = f"deepspeed ZeRO-{stage}" if strategy == "deepspeed" else strategy
        log.info("distributed_strategy auto: %.2fB parameters -> %s", num_parameters / 1e9, chosen)
    if strategy == "deepspeed":
        return DeepSpeedEngine(module, tc, env, device, stage, forward)
    return TorchEngine(module, tc, env, device, forward)


__all__ = [
    "DeepSpeedEngine",
    "TorchEngine",
    "barrier",
    "build_engine",
    "checkpoint_format",
    "frozen_forward",
    "is_partitioned",
    "partitioned_loading",
]
