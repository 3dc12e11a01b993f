"""Weight snapshots (DESIGN.md section 3): the policy's tensors copied into one flat, 64-byte aligned
buffer described by a `WeightsManifest` and cut into chunks hashed with xxh3-64; the reused (and, for
same-host samplers, shared-memory) buffers they go into; loading one into a model. Both sync methods
(`zmq_server`/`zmq_client`, `filesystem`) move these snapshots.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import xxhash

from tandem.transport.wire import WEIGHT_DTYPES
from tandem.types import TensorSpec, TrainerStatus, WeightsManifest

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20  # below glibc's 32 MiB mmap ceiling: received chunks reuse warm heap pages
ALIGN = 64
SHM_DIR = "/dev/shm"  # where shared snapshot files go (`shared_prefix`)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


class WeightSyncError(RuntimeError):
    """Weights that cannot be applied: a corrupt chunk, or weights of another model."""


@dataclass
class Snapshot:
    manifest: WeightsManifest
    flat: torch.Tensor  # uint8 [total_bytes], never modified once published
    path: str | None = None  # the /dev/shm file `flat` maps, when it is shared
    _hashed: Snapshot | None = field(default=None, repr=False, compare=False)

    def hashed(self) -> Snapshot:
        """This snapshot with every chunk's hash filled in (computed once, on first need: a sampler
        lent the file never needs them, one fetching chunks or reading files does)."""
        if all(digest for _, _, digest in self.manifest.chunks):
            return self
        if self._hashed is None:
            data = memoryview(self.flat.numpy())
            chunks = tuple((o, n, chunk_hash(data[o : o + n])) for o, n, _ in self.manifest.chunks)
            self._hashed = Snapshot(replace(self.manifest, chunks=chunks), self.flat, self.path)
        return self._hashed

    def chunk(self, index: int) -> memoryview:
        offset, nbytes, _ = self.manifest.chunks[index]
        return memoryview(self.flat.numpy())[offset : offset + nbytes]


def chunk_hash(view) -> str:
    return xxhash.xxh3_64_hexdigest(view)


def snapshot_layout(
    named_tensors: list[tuple[str, torch.Tensor]], dtype: str | None
) -> tuple[list[TensorSpec], int]:
    """Where each tensor goes in the flat buffer (64-byte aligned) and the buffer's size."""
    specs, offset = [], 0
    for name, t in named_tensors:
        name_dtype = dtype or _DTYPE_NAMES.get(t.dtype)
        if name_dtype not in WEIGHT_DTYPES:
            raise WeightSyncError(
                f"tensor {name} has dtype {t.dtype}; weights sync carries {sorted(WEIGHT_DTYPES)}"
            )
        nbytes = t.numel() * WEIGHT_DTYPES[name_dtype]
        specs.append(TensorSpec(name, name_dtype, tuple(t.shape), offset, nbytes))
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return specs, offset


def take_snapshot(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    run_id: str,
    dtype: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    out: torch.Tensor | None = None,
    path: str | None = None,
    hashed: bool = True,
) -> Snapshot:
    """Copy tensors (any device) into a flat CPU buffer, cast to `dtype` (None: keep each one's).

    `out`, a buffer of an earlier snapshot of the same model that nobody reads any more, is reused:
    a fresh 0.5 GB buffer costs 8x a copy into warm pages (page faults), measured in
    benchmarks/weight_sync.py. `path` names the shared file `out` maps, if any. `hashed=False`
    leaves the chunk hashes empty until `Snapshot.hashed()` is asked for them."""
    items = [(name, t.detach()) for name, t in named_tensors]
    specs, offset = snapshot_layout(items, dtype)
    reuse = out is not None and out.numel() == offset
    flat = out if reuse else torch.empty(offset, dtype=torch.uint8)
    # from a GPU: every copy queued at once, one wait at the end. Into page-locked memory (a pinned heap
    # buffer, a registered /dev/shm one: SnapshotBuffers) the copies then overlap; a copy into pageable
    # memory returns only once done (CUDA's rule for device-to-host), so it is correct there too
    devices = {t.device for _, t in items if t.is_cuda}  # each copy runs on its source device's stream
    batched = bool(devices)
    end = 0
    for spec, (_, t) in zip(specs, items):
        flat[end : spec.offset] = 0  # alignment padding: keep the buffer (and its hashes) deterministic
        tensor_view(flat, spec).copy_(t, non_blocking=batched)
        end = spec.offset + spec.nbytes
    flat[end:] = 0
    for device in devices:
        torch.cuda.synchronize(device)
    chunks = tuple((start, min(chunk_bytes, offset - start), "") for start in range(0, offset, chunk_bytes))
    manifest = WeightsManifest(version, run_id, offset, tuple(specs), chunks)
    snapshot = Snapshot(manifest, flat, path if reuse else None)
    return snapshot.hashed() if hashed else snapshot


class SnapshotBuffers:
    """Snapshots into reused buffers: one that no fetch reads any more (`publisher.busy`) is
    overwritten; otherwise a new one is made and the oldest leaves the pool (zmq keeps a buffer
    alive while its chunks are queued).

    With `shared_prefix` (e.g. /dev/shm/tandem-<run id>) each buffer maps a memory file that is
    unlinked as soon as it is made: same-host samplers open it as /proc/<trainer pid>/fd/<fd>, and
    the kernel frees it when the last process holding it goes, so even a killed trainer leaves
    nothing behind in /dev/shm. A file without room is one log line and heap buffers from then on
    (samplers fetch chunks over the socket), never a SIGBUS (`reserve`). For a GPU trainer every
    buffer, shared or heap, is page-locked (`_pin`)."""

    def __init__(self, keep: int = 3, *, shared_prefix: str | None = None) -> None:
        self.keep = keep
        self.shared_prefix = shared_prefix
        self.page_lock = True  # until page-locking a buffer fails once
        # (buffer, fd of its file, CUDA device it is page-locked for)
        self._buffers: list[tuple[torch.Tensor, int | None, int | None]] = []
        self._made = 0

    def snapshot(self, named_tensors, *, publisher, **kwargs) -> Snapshot:
        named = [(name, t.detach()) for name, t in named_tensors]
        spare = next((b for b in self._buffers if not publisher.busy(b[0])), None)
        if spare is None:
            spare = self._new_buffer(snapshot_layout(named, kwargs.get("dtype"))[1], _cuda_device(named))
        path = None if spare[1] is None else f"/proc/{os.getpid()}/fd/{spare[1]}"
        snap = take_snapshot(named, out=spare[0], path=path, **kwargs)
        if snap.flat is not spare[0]:  # sizes changed (not the same model): a plain heap buffer
            spare = (snap.flat, None, None)
        if all(b[0] is not spare[0] for b in self._buffers):
            self._buffers.append(spare)
            for old in self._buffers[: -self.keep]:
                _release(*old)
            self._buffers = self._buffers[-self.keep :]
        return snap

    def _new_buffer(self, nbytes: int, device: int | None) -> tuple[torch.Tensor, int | None, int | None]:
        if self.shared_prefix is None:
            flat = _heap_buffer(nbytes)
            return flat, None, self._pin(flat, device)
        path = f"{self.shared_prefix}-{os.getpid()}-{self._made}.weights"
        self._made += 1
        fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)  # nothing named is left: the open fd (and mappings) keep it alive
            os.ftruncate(fd, nbytes)
            reserve(fd, nbytes)
            flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError) as err:  # no /dev/shm or /proc, or it is full: lend nothing
            _close(fd)
            Path(path).unlink(missing_ok=True)
            self.shared_prefix = None  # one line, once: later buffers go to the heap straight away
            log.warning("%s", no_shared_buffer_message(Path(path).parent, nbytes, self.keep, err))
            flat = _heap_buffer(nbytes)
            return flat, None, self._pin(flat, device)
        return flat, fd, self._pin(flat, device)

    def _pin(self, flat: torch.Tensor, device: int | None) -> int | None:
        """Page-lock a buffer (shared file or heap) that a GPU's parameters are copied into; the
        device it is registered for (None: not registered, a CPU trainer or a failure, said once).
        Heap buffers are registered too rather than allocated with pin_memory=True, whose caching
        allocator rounds up to a power of two (a 6.2 GB snapshot would hold 8 GB page-locked).

        Assumed, not measured (no GPU here): a device-to-host copy into pageable memory goes through
        the driver's staging buffer one tensor at a time, commonly at half the page-locked rate or
        less (that is ~25 GB/s on PCIe 4 x16, ~50 on PCIe 5); registering pins pages the file already
        has (reserve), one pass, once per buffer. NCCL registers its /dev/shm segments the same way."""
        if device is None or not self.page_lock or flat.numel() == 0:
            return None
        code = _cuda_host_call(
            "cudaHostRegister", device, flat.data_ptr(), flat.numel(), _HOST_REGISTER_PORTABLE
        )
        if code == 0:
            return device
        self.page_lock = False
        log.info(
            "weights: cannot page-lock snapshot buffers (cudaError %d); GPU copies into them wait",
            code,
        )
        return None

    def close(self) -> None:
        for buffer in self._buffers:
            _release(*buffer)
        self._buffers = []


def reserve(fd: int, nbytes: int) -> None:
    """Give a memory file its pages now. ftruncate only sets the size: tmpfs grants any size and a
    write past its room (Docker's default /dev/shm is 64 MB) then kills the process with SIGBUS,
    which nothing can catch. posix_fallocate takes the pages up front, so a /dev/shm without room is
    an OSError (ENOSPC) here instead. Where the filesystem cannot (EOPNOTSUPP; EINVAL on some; musl
    does not emulate it as glibc does) or Python has no posix_fallocate, the pages are written: a
    lack of room is then an OSError from write(2), again never a fault. (Free space from statvfs
    would not do: another process, NCCL's for one, may take it before the pages are touched.)"""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, nbytes)
            return
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # EINVAL also for nbytes == 0
                raise
    zeros = memoryview(bytes(min(nbytes, 2**20)))
    offset = 0
    while offset < nbytes:
        written = os.pwrite(fd, zeros[: nbytes - offset], offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, f"no room for {nbytes} bytes")
        offset += written


def no_shared_buffer_message(directory: Path, nbytes: int, keep: int, err: Exception) -> str:
    """The one line a trainer logs when it cannot share its snapshots: why, and the fix."""
    try:
        info = os.statvfs(directory)
        free = _size(info.f_bavail * info.f_frsize)
    except OSError:
        free = "unknown"
    need = keep * nbytes
    return (
        f"weights: no shared-memory buffer for a {_size(nbytes)} snapshot in {directory} ({err}); samplers "
        f"on this host fetch the weights over the socket instead. The trainer keeps up to {keep} snapshots "
        f"({_size(need)}); {directory} has {free} free. In a container, /dev/shm is 64 MB unless started "
        f"with --ipc=host or --shm-size={math.ceil(need / 2**30) + 1}g"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _cuda_device(named_tensors: list[tuple[str, torch.Tensor]]) -> int | None:
    """The CUDA device a snapshot copies from (None: all its tensors are on the CPU)."""
    return next((t.get_device() for _, t in named_tensors if t.is_cuda), None)


def _cuda_host_call(name: str, device: int, *args: int) -> int:
    """cudaHostRegister / cudaHostUnregister for `device`; its cudaError (0: success, -1: no call).
    In a thread of its own: a failed CUDA call stays in its thread's last-error slot, and the next
    kernel torch launched from the trainer's thread would raise it as that kernel's error."""
    result = [-1]

    def call() -> None:
        try:
            with torch.cuda.device(device):
                result[0] = int(getattr(torch.cuda.cudart(), name)(*args))
        except (RuntimeError, AttributeError) as err:  # no CUDA runtime bindings in this torch
            log.debug("weights: %s failed: %s", name, err)

    thread = threading.Thread(target=call, name="tandem-cuda-host")
    thread.start()
    thread.join()
    return result[0]


def _release(flat: torch.Tensor, fd: int | None, device: int | None) -> None:
    """A buffer leaves the pool: unpinned (before its mapping can go) and its file closed; a fetch
    still reading it keeps the mapping alive."""
    if device is not None:
        _cuda_host_call("cudaHostUnregister", device, flat.data_ptr())
    _close(fd)


def _heap_buffer(nbytes: int) -> torch.Tensor:
    """A snapshot buffer in this process's memory (page-locked afterwards for a GPU trainer:
    SnapshotBuffers._pin)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def shared_prefix(run_id: str, shm_dir: str = SHM_DIR) -> str | None:
    """Where a trainer makes its shared snapshot files: `shm_dir` (/dev/shm: memory, not disk), when
    this system has it and /proc to reach an open file of another process."""
    if Path(shm_dir).is_dir() and Path(f"/proc/{os.getpid()}/fd").is_dir():
        return f"{shm_dir}/tandem-{run_id}"
    return None


def tensor_view(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` describes, as a view into the flat uint8 buffer."""
    raw = flat[spec.offset : spec.offset + spec.nbytes]
    return raw.view(_TORCH_DTYPES[spec.dtype]).view(spec.shape)


@torch.no_grad()
def load_weights(
    model: torch.nn.Module,
    flat: torch.Tensor,
    manifest: WeightsManifest,
    params: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy a received version into `model`'s parameters (casting to their dtype and device);
    `params`: the named parameters that travel (default: all of them; LoRA: the adapters)."""
    params = dict(model.named_parameters()) if params is None else params
    names = {t.name for t in manifest.tensors}
    if names != set(params):
        missing, extra = sorted(set(params) - names), sorted(names - set(params))
        raise WeightSyncError(
            f"weights v{manifest.version} do not match this model: missing {missing[:3]}, unexpected "
            f"{extra[:3]}; the sampler and the trainer must load the same model.policy"
        )
    for spec in manifest.tensors:
        param = params[spec.name]
        if tuple(param.shape) != spec.shape:
            raise WeightSyncError(
                f"{spec.name}: trainer sends shape {list(spec.shape)}, model has {list(param.shape)}"
            )
        param.copy_(tensor_view(flat, spec))


def verify_chunks(flat: torch.Tensor, manifest: WeightsManifest) -> None:
    data = memoryview(flat.numpy())
    for i, (offset, nbytes, digest) in enumerate(manifest.chunks):
        if chunk_hash(data[offset : offset + nbytes]) != digest:
            raise WeightSyncError(f"weights v{manifest.version}: chunk {i} fails its checksum")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def is_news(status: TrainerStatus, newer_than: int, run_id: str | None) -> bool:
    """Whether `status` tells a sampler holding `newer_than` (of run `run_id`) something new."""
    return status.finished or status.version > newer_than or (run_id is not None and status.run_id != run_id)
