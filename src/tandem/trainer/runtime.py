"""Process set-up shared by the training loops: device, threads, seeds, precision, memory readings."""

from __future__ import annotations

import contextlib
import ctypes
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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only (musl has no mallopt)
        return libc
    except (OSError, AttributeError):
        return None


def tune_allocator() -> bool:
    """Give freed tensor memory back to the OS (glibc): allocations of 1 MiB and more get their
    own mappings, released on free. glibc's default raises that threshold to 32 MiB after the
    first large free, so a training step's freed gradients and a generation batch's caches end
    up interleaved on the heap and the process keeps a gigabyte it no longer uses (measured:
    peak RSS 4.3 GB -> see benchmarks/grpo_step.py). Returns whether it applied."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES)
    )


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
