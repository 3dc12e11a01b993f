"""Process set-up shared by the training loops: device, threads, seeds, precision, memory readings."""

from __future__ import annotations

import contextlib
import ctypes
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


def use_device(device: torch.device, *, tf32: bool = True) -> None:
    """Make `device` this process's own. On CUDA: its index becomes the current device, and fp32
    matmuls and convolutions run on TF32 tensor cores unless `tf32` is false (the default of HF's
    Trainer and of most RL frameworks on Ampere and later: about 8x the fp32 rate, with a 10-bit
    mantissa in the products and fp32 accumulation). Nothing on the CPU."""
    if device.type != "cuda":
        return
    global _TRIM
    _TRIM = False  # the tensors live on the GPU: the host heap stays small, nothing to hand back
    if device.index is not None:
        torch.cuda.set_device(device)
    # set_float32_matmul_precision, not the newer fp32_precision attributes: after those, the
    # getters torch.compile and user code still call (get_float32_matmul_precision, allow_tf32) raise
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (about 2.5x fp32 here); without them torch
    emulates bf16 and it is slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_mixed_precision(spec: str, device: torch.device) -> tuple[str, str]:
    """(choice, why) for training.mixed_precision; `auto` is the seeds' rule: bf16 where the device
    supports it, else fp16 on CUDA, else no mixed precision (fp32) on a CPU without fast bf16."""
    if spec != "auto":
        return spec, "as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{torch.cuda.get_device_name(device)} supports bf16"
        return "fp16", f"{torch.cuda.get_device_name(device)} has no bf16"
    if cpu_has_fast_bf16():
        return "bf16", "this CPU computes bf16 natively (avx512_bf16/amx)"
    return "no", "this CPU has no native bf16 (fp32 is faster than emulated bf16)"


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


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl has no malloc_trim)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


_TRIM = True  # off once this process computes on a GPU (use_device)


def trim_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc malloc_trim); called at phase boundaries
    (after each backward, the optimizer step, generation, the reference pass).

    glibc keeps freed tensor memory on its heap, so the training step's activations and the next
    generation's caches end up interleaved and the process keeps a gigabyte it no longer uses.
    Trimming between phases gives it back for about nothing; the alternative, a 1 MiB mmap
    threshold (every large tensor its own mapping), costs a third of the training step in page
    faults (measured: benchmarks/grpo_step.py, README "GRPO step")."""
    if _LIBC is not None and _TRIM:
        _LIBC.malloc_trim(0)


def trim_memory_in_training(model: torch.nn.Module, every: int = 10) -> int:
    """Trim also inside a training forward and backward, every `every` decoder layers: the heap
    otherwise grows by the step's freed temporaries until the next phase boundary. Each trim costs
    page faults when the memory is taken again, so `every` trades time for peak (the measurements
    behind 10 are in benchmarks/MEASUREMENTS.md). Forwards without gradients (generation,
    reference) are left alone. Returns the number of layers hooked."""
    if _LIBC is None or any(p.is_cuda for p in model.parameters()):  # a GPU's host heap stays small
        return 0
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return 0
    layers = max(lists, key=len)  # the decoder's blocks

    def on_grad(grad: torch.Tensor) -> None:
        trim_memory()

    def after_forward(module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        trim_memory()
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(on_grad)  # runs when this layer's backward starts

    hooked = list(layers)[every - 1 :: every]
    for layer in hooked:
        layer.register_forward_hook(after_forward)
    return len(hooked)


def peak_rss_gb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1e9 if sys.platform == "darwin" else 1e6 / 1.024)


def gpu_memory() -> dict[str, float]:
    """This process's CUDA memory, as the seeds log it: allocated and reserved now, and the peak
    since the previous row (the peak counter is reset after each read). Empty off CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    gb = 1e9
    out = {
        "gpu_memory_allocated_gb": torch.cuda.memory_allocated() / gb,
        "gpu_memory_reserved_gb": torch.cuda.memory_reserved() / gb,
        "gpu_memory_peak_gb": torch.cuda.max_memory_allocated() / gb,
    }
    torch.cuda.reset_peak_memory_stats()
    return out
