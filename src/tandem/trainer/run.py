"""What every training loop does around its loop: process set-up, the run folder, the policy,
checkpoints and the final export. Each method's loop (grpo, sft, rm, dpo, ppo) calls these.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.atomic import remove_leftovers
from tandem.config import Config, ConfigError, ModelConfig, TrainingConfig, config_to_dict, dump_config
from tandem.distributed.engine import is_partitioned, partitioned_loading
from tandem.distributed.env import DistEnv, barrier, broadcast_json, init_distributed, main_first, shutdown
from tandem.distributed.runtime import (
    resolve_device,
    resolve_mixed_precision,
    set_seed,
    set_threads,
    trim_memory_in_training,
    use_device,
)
from tandem.models.loading import (
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    model_kwargs,
    resolve_model_path,
)
from tandem.models.lora import apply_lora, is_lora
from tandem.runlog import attach_run_log
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.metrics import SUPERVISED_FIELDS, MetricsLogger

log = logging.getLogger(__name__)


def run_distributed(cfg: Config, train: Callable[[Config, DistEnv, torch.device], Path]) -> Path:
    """Seeds, threads, device and process group around `train(cfg, env, device)`; under torchrun or
    the deepspeed launcher every rank calls this. The group is torn down even when training fails."""
    set_seed(cfg.seed)
    set_threads(cfg.training.num_threads)
    device = resolve_device(cfg.training.device)
    tc = cfg.training
    env = init_distributed(tc.distributed_strategy, device.type, tc.dist_backend, tc.dist_timeout_s)
    if device.type == "cuda" and env.active:
        device = torch.device("cuda", env.local_rank)
    use_device(device, tf32=tc.tf32)
    tc.mixed_precision, why = resolve_mixed_precision(tc.mixed_precision, device)
    if why != "as configured" and env.is_main:
        log.info("training.mixed_precision auto -> %s: %s", tc.mixed_precision, why)
    try:
        final = train(cfg, env, device)
    except BaseException:
        shutdown(env, clean=False)
        raise
    shutdown(env)
    return final


def open_run(cfg: Config, env: DistEnv) -> Path | None:
    """Rank 0 prepares the run folder (checkpoint.prepare_run_dir: resume, refuse, or move an
    unfinished record aside) and writes config.yaml; every rank returns the checkpoint to resume
    (None for a fresh run)."""
    run_dir = cfg.run_dir
    start = None
    if env.is_main:
        try:
            # a decoupled trainer's samplers may be writing logs/ and samplers/ already
            resume = ckpt.prepare_run_dir(
                run_dir,
                cfg.training.resume_from_checkpoint,
                samplers_running=cfg.method in ("grpo", "ppo") and cfg.pipeline.mode == "decoupled",
            )
        except (ckpt.RunFolderTaken, FileNotFoundError) as err:
            start = {"error": str(err)}
        else:
            start = {"resume": str(resume) if resume else None}
            run_dir.mkdir(parents=True, exist_ok=True)
            attach_run_log(run_dir)
            for folder in (run_dir, run_dir / "checkpoints", run_dir / "weights"):
                remove_leftovers(folder)  # of saves a killed trainer left half-written
            dump_config(cfg, run_dir / "config.yaml")
            _say_where_it_starts(cfg, resume)
    start = broadcast_json(env, start)
    if "error" in start:
        raise FileExistsError(start["error"])
    return Path(start["resume"]) if start["resume"] else None


def _say_where_it_starts(cfg: Config, resume: Path | None) -> None:
    if resume is None:
        log.info("starting %s in %s", cfg.method, cfg.run_dir)
        return
    step = ckpt.checkpoint_step(resume)
    if step >= cfg.training.max_steps:
        log.info(
            "%s already finished (step %d of training.max_steps=%d): nothing to train; the final "
            "model is written again. Raise training.max_steps to continue it",
            cfg.run_dir,
            step,
            cfg.training.max_steps,
        )
    else:
        log.info("resuming %s from %s (step %d of %d)", cfg.run_dir, resume, step, cfg.training.max_steps)


def load_policy(cfg: Config, env: DistEnv, device: torch.device, loader: Callable = load_causal_lm):
    """(tokenizer, trainable model): model.policy loaded by `loader` (load_model), LoRA applied when
    enabled, gradient checkpointing and use_cache=False set for training."""
    with main_first(env):
        tokenizer = load_tokenizer(
            cfg.model.tokenizer or cfg.model.policy, trust_remote_code=cfg.model.trust_remote_code
        )
    model = load_model(cfg.model, cfg.training, env, device, cfg.model.policy, loader)
    if cfg.model.lora.enabled:
        model = apply_lora(model, cfg.model.lora)  # only the adapters (and any new head) train
    if cfg.training.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is None:  # non-reentrant: DDP and ZeRO hooks see each parameter once
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable()
    model.config.use_cache = False
    trim_memory_in_training(model)
    return tokenizer, model


def load_model(
    mc: ModelConfig,
    tc: TrainingConfig,
    env: DistEnv,
    device: torch.device,
    spec: str,
    loader=load_causal_lm,
    **kwargs,
):
    """Model `spec` loaded by `loader` in model.dtype on every rank. Under ZeRO-3 each rank builds
    only its shard (partitioned_loading: deepspeed.zero.Init), all ranks at once; otherwise rank 0
    loads first, then the others, so that their peaks do not add up."""
    with main_first(env):
        # a GGUF file or the embedded model becomes an HF folder here, once, by rank 0 alone (in
        # full: zero.Init cannot read a GGUF); the sharded load below reads that folder
        path = resolve_model_path(spec)
    num_parameters = functools.partial(count_parameters, path, trust_remote_code=mc.trust_remote_code)
    hidden = _hidden_size(path, mc.trust_remote_code) if tc.deepspeed_config else None  # its "auto" buckets
    with partitioned_loading(tc, env, mc.dtype, num_parameters, hidden) as partitioned:
        in_turn = contextlib.nullcontext() if partitioned else main_first(env)
        with in_turn:  # sharded: the shards stay where zero.Init put them (device None)
            on = None if partitioned else device
            model = loader(path, dtype=mc.dtype, **model_kwargs(mc, on), **kwargs)
    if partitioned and not is_partitioned(model):  # transformers skips zero.Init for a quantized checkpoint
        log.warning("%s was loaded whole on every rank: transformers did not shard it at load", spec)
        model = model.to(device)
    elif partitioned and env.is_main:
        log.info("%s loaded under deepspeed.zero.Init: each rank holds 1/%d of it", spec, env.world_size)
    return model


def _hidden_size(path: str, trust_remote_code: bool) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


def batches_per_epoch(num_items: int, batch_size: int, what: str) -> int:
    """Optimizer steps per epoch of a data loop (sft, rm, dpo): every item once, the last batch short
    when `batch_size` does not divide `num_items` (the one rule of all three, README "Batches")."""
    if num_items == 0:
        raise ConfigError(f"`data.num_examples`: there are no training {what}; give a data set with some")
    return math.ceil(num_items / batch_size)


def epoch_batches(
    num_items: int, batch_size: int, epoch: int, seed: int, shuffle: bool, salt: str
) -> list[list[int]]:
    """One epoch's optimizer batches of item indices, the last one possibly short."""
    order = epoch_order(num_items, epoch, seed, shuffle, salt)
    return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]


def epoch_order(num_items: int, epoch: int, seed: int, shuffle: bool, salt: str) -> list[int]:
    """The item order of one epoch, a function of (seed, epoch) alone: a resumed run finds its
    place from the step number."""
    order = list(range(num_items))
    if shuffle:
        random.Random(f"{salt}/{seed}/{epoch}").shuffle(order)
    return order


def save_data_loop(
    checkpoints_dir: Path,
    step: int,
    engine,
    env: DistEnv,
    tokenizer,
    steps_per_epoch: int,
    data_state: dict,
    keep: int,
) -> None:
    """A checkpoint of a data loop: the step is the data position (epoch_order gives the order)."""
    epoch, index = divmod(step, steps_per_epoch)
    state = {"epoch": epoch, "batch_in_epoch": index, **data_state}
    save(checkpoints_dir, step, engine, env, None, tokenizer, state, keep)


def resume_data_loop(
    resume_path: Path | None,
    engine,
    env: DistEnv,
    data_state: dict,
    restore: Callable[[dict], None] | None = None,
) -> int:
    """Load the checkpoint of a loop over a fixed data set (sft, rm, dpo) and return its step (0 for a
    fresh run). Those loops draw their batches from (seed, epoch), so the step is the data position,
    valid only while `data_state` (data size, global batch) is what the checkpoint recorded.
    `restore(saved)` gets the whole saved trainer state (a method's own, e.g. Safe-MM-DPO's lambda)."""
    if resume_path is None:
        return 0
    saved = ckpt.load_checkpoint(resume_path, engine=engine, env=env)
    if restore is not None:
        restore(saved)
    found = {key: saved.get(key) for key in data_state}
    if found != data_state:
        raise ConfigError(
            f"training.resume_from_checkpoint: {resume_path} was written with {found}, this run has "
            f"{data_state}; resume with the same data.* settings and micro_batch_size x "
            "gradient_accumulation_steps x ranks, or start a new run"
        )
    if env.is_main:
        log.info("resumed from %s at step %d", resume_path, saved["step"])
    return saved["step"]


def data_loop_logger(cfg: Config, env: DistEnv, step: int) -> MetricsLogger | None:
    """Rank 0's metrics.jsonl for sft, rm and dpo rows (rows past `step` from a crash are dropped)."""
    if not env.is_main:
        return None
    return MetricsLogger(
        cfg.run_dir,
        cfg.training.report_to,
        resume_step=step,
        config=config_to_dict(cfg),
        required=SUPERVISED_FIELDS,
    )


def save(
    checkpoints_dir: Path,
    step: int,
    engine,
    env: DistEnv,
    generator,
    tokenizer,
    state: dict,
    keep: int,
    write_extra: Callable[[Path], None] | None = None,
):
    """An atomic checkpoint (every rank calls this), then the oldest beyond `keep` go.
    `write_extra(folder)` adds files of the method's own (PPO's value head) before it commits."""
    ckpt.save_checkpoint(
        checkpoints_dir,
        step,
        engine=engine,
        env=env,
        trainer_state=state if env.is_main else {},
        generator=generator,
        tokenizer=tokenizer,
        write_extra=write_extra,
    )
    if env.is_main:
        ckpt.prune_checkpoints(checkpoints_dir, keep)


def export_final(
    engine, env: DistEnv, tokenizer, out: Path, write_extra: Callable[[Path], None] | None = None
) -> Path:
    """The trained model as an HF folder that from_pretrained loads (under ZeRO-3 every rank helps
    gather it; rank 0 writes it). A LoRA model gives its adapters in out/adapter and the merged
    model in out itself; `write_extra(folder)` adds the method's own files (PPO's value head)."""

    def write(tmp: Path) -> None:
        model = engine.module
        if is_lora(model):
            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            model = model.merge_and_unload()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if write_extra is not None:
            write_extra(tmp)

    with engine.gathered():
        ckpt.require_finite(engine.module, str(out))
        if env.is_main:
            ckpt.atomic_dir(out, write)
    barrier(env)
    return out
