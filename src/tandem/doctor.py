"""`tandem doctor`: what this machine and install can run (versions, devices, optional parts)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    import torch

    from tandem.models.loading import cache_dir, embedded_gguf_path

    lines = [f"python        {platform.python_version()} on {platform.machine()} ({os.cpu_count()} cpus)"]
    for package in (
        "torch",
        "transformers",
        "accelerate",
        "gguf",
        "pyzmq",
        "deepspeed",
        "peft",
        "tensorboard",
    ):
        lines.append(f"{package:<13} {_version(package)}")
    lines.append(f"torch threads {torch.get_num_threads()}")
    lines.append(
        f"cuda          {torch.cuda.is_available()}"
        + (
            f" ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})"
            if torch.cuda.is_available()
            else ""
        )
    )
    from tandem.distributed.runtime import cpu_has_fast_bf16

    fast_bf16 = cpu_has_fast_bf16()
    lines.append(
        f"cpu bf16      {'native (avx512_bf16/amx): sampling.dtype=bfloat16 pays off' if fast_bf16 else 'emulated: keep float32 on this CPU'}"
    )
    try:
        lines.append(f"embedded gguf {embedded_gguf_path()}")
    except RuntimeError as err:
        lines.append(f"embedded gguf missing: {err}")
    converted = cache_dir() / "models" / "SmolLM2-135M-Instruct" / "config.json"
    lines.append(
        f"model cache   {converted.parent} ({'converted' if converted.is_file() else 'converted on first use'})"
    )
    lines.append(
        f"distributed   gloo={torch.distributed.is_gloo_available()} nccl={torch.distributed.is_nccl_available()}"
        if torch.distributed.is_available()
        else "distributed   unavailable in this torch build"
    )
    return "\n".join(lines)
