"""Process set-up shared by the training loops: device, threads, seeds, precision, memory readings."""

from __future__ import annotations

import contextlib
import logging
import random
import resource
import sys

import torch

from tandem.config import ConfigError


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"training.device={spec} but CUDA is not available; use training.device=cpu")
    return torch.device(spec)


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def autocast(device: torch.device, mixed_precision: str):
    """bf16/fp16 autocast for the forward pass; master weights and optimizer stay in their dtype."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(device: torch.device, mixed_precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling against gradient underflow; bf16 has fp32's exponent range."""
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def peak_rss_gb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1e9 if sys.platform == "darwin" else 1e6 / 1.024)


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
