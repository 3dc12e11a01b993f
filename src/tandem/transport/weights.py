"""Weight sync, trainer -> samplers (DESIGN.md section 3): versioned snapshots in one flat buffer.

A snapshot copies the policy's tensors into one contiguous byte buffer (64-byte aligned, cast to
the sync dtype), described by a `WeightsManifest` and cut into chunks hashed with xxh3-64. Two
methods move it:
- `zmq`: the trainer's `WeightServer` (a ROUTER on the sync port, in its own thread) sends the
  newest snapshot's chunks straight from memory to whoever asks; `WeightClient` (a DEALER in the
  sampler) receives each chunk directly into its buffer and checks its hash. Snapshots live in
  (unlinked) /dev/shm files, so a sampler on the trainer's host (one that reached it over the ipc
  twin) is instead lent the snapshot itself: it maps the file and loads straight from it, no bytes
  sent.
  The lease says until when the trainer leaves that buffer alone; a load that outlasts it is
  discarded and fetched again as chunks.
- `fs` (the seed's method): `FsWeightWriter` writes `vNNNNNNNN/{weights.bin, manifest.json}` into
  a temporary folder, fsyncs and renames it, then prunes old versions; `FsWeightReader` only ever
  sees complete versions and checks every chunk's hash.
Both carry the trainer's `TrainerStatus` (newest version, starved, finished) the same way, and the
sampler applies a version between generation batches only (`load_weights`).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import xxhash
import zmq

from tandem.atomic import atomic_dir, atomic_write_text
from tandem.config import CurveConfig
from tandem.transport.auth import CountingAuthenticator, HandshakeWatch, configure_client, configure_server
from tandem.transport.wire import (
    WEIGHT_DTYPES,
    WireError,
    decode_control,
    decode_weights_header,
    encode_control,
    encode_weights_chunk,
    manifest_from_json,
    manifest_to_json,
)
from tandem.types import TensorSpec, TrainerStatus, WeightsManifest

log = logging.getLogger(__name__)

DEFAULT_SYNC_PORT = 5556
CHUNK_BYTES = 8 * 2**20  # below glibc's 32 MiB mmap ceiling: received chunks reuse warm heap pages
LEASE_S = 10.0  # how long a lent shared snapshot stays untouched (a load takes well under a second)
ALIGN = 64
MAX_REQUEST_BYTES = 64 * 2**10
POLL_SLICE_S = 0.25  # a waiting client looks at its handshakes this often
SHM_DIR = "/dev/shm"  # where shared snapshot files go (`shared_prefix`)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context
_SHARED_FILE = re.compile(r"/proc/\d+/fd/\d+")  # how a trainer lends its (unlinked) snapshot file
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


class WeightSyncError(RuntimeError):
    """Weights that cannot be applied: a corrupt chunk, or weights of another model."""


# ----------------------------------------------------------------------------- snapshots


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
            chunks = tuple((o, n, _hash(data[o : o + n])) for o, n, _ in self.manifest.chunks)
            self._hashed = Snapshot(replace(self.manifest, chunks=chunks), self.flat, self.path)
        return self._hashed

    def chunk(self, index: int) -> memoryview:
        offset, nbytes, _ = self.manifest.chunks[index]
        return memoryview(self.flat.numpy())[offset : offset + nbytes]


def _hash(view) -> str:
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
        if _hash(data[offset : offset + nbytes]) != digest:
            raise WeightSyncError(f"weights v{manifest.version}: chunk {i} fails its checksum")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


# ----------------------------------------------------------------------------- zmq method

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def local_sync_address(port: int) -> str:
    """The Unix-socket twin of tcp://*:port that a trainer's WeightServer also listens on."""
    return f"ipc://{tempfile.gettempdir()}/tandem-sync-{port}.ipc"


def sync_address(host: str, port: int) -> str:
    """Where a sampler fetches weights: the ipc twin when the trainer is on this host and up."""
    local = local_sync_address(port)
    if host in LOCAL_HOSTS and Path(local.removeprefix("ipc://")).exists():
        return local
    return f"tcp://{host}:{port}"


class WeightServer:
    """Trainer side of the `zmq` method: serves the newest snapshot and the trainer's status.

    A ROUTER bound on the sync port, driven by one background thread. Requests are one-frame
    control messages: `status` (optionally long-polled until a version newer than `newer_than`
    appears) and `fetch` (all chunks of the newest snapshot, sent zero-copy). Malformed requests
    are dropped and counted in `dropped`; a slow sampler never blocks the trainer. With CURVE,
    `auth` (the context's `CountingAuthenticator`) counts the handshakes it refuses.
    """

    def __init__(
        self,
        address: str,
        *,
        run_id: str,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
        auth: CountingAuthenticator | None = None,
    ) -> None:
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises, never vanishes
        self._router.setsockopt(zmq.SNDHWM, 1000)  # chunks are zero-copy references: cheap to queue
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            configure_server(self._router, curve or CurveConfig(), auth)
            self._router.bind(address)
        except (zmq.ZMQError, OSError) as err:  # OSError: a missing or unreadable CURVE key file
            self._router.close()
            if self._own_context:
                self._context.term()
            if isinstance(err, zmq.ZMQError) and err.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"cannot bind the weight-sync channel to {address}: address already in use (is another "
                    "trainer running?); set pipeline.sync_port to a free port",
                ) from err
            if isinstance(err, zmq.ZMQError):
                raise OSError(err.errno, f"cannot bind the weight-sync channel to {address}: {err}") from err
            raise
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.local_address = None
        port = self.address.rsplit(":", 1)[-1]
        if self.address.startswith("tcp://") and port.isdigit():
            # samplers on this host fetch over a Unix socket: twice loopback TCP's bandwidth here
            try:
                self._router.bind(local_sync_address(int(port)))
                self.local_address = local_sync_address(int(port))
            except zmq.ZMQError as err:
                log.info("weight server: no local ipc endpoint (%s); samplers use %s", err, self.address)
        wake = f"inproc://tandem-weights-{id(self)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.setsockopt(zmq.LINGER, 0)
        self._wake_in.bind(wake)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake)
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._status = TrainerStatus(version=-1, run_id=run_id)
        self._stop = False
        self._in_flight: list[tuple[int, zmq.MessageTracker]] = []  # (buffer address, tracker)
        self._leases: list[tuple[int, float, bytes]] = []  # (buffer address, monotonic end, borrower)
        self._seen: dict[bytes, float] = {}  # sampler identity -> when it last asked something
        self._told_finished: set[bytes] = set()
        self._last_probe = 0.0
        self.dropped: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._serve, name="tandem-weight-server", daemon=True)
        self._thread.start()

    # --- main thread
    def publish(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot
            self._status = replace(self._status, version=snapshot.manifest.version)
        self._wake_out.send(b"")

    def busy(self, flat: torch.Tensor) -> bool:
        """Whether a fetch still has chunks of this buffer queued (zero-copy: they must not change)."""
        with self._lock:
            self._in_flight = [(ptr, t) for ptr, t in self._in_flight if not t.done]
            now = time.monotonic()
            self._leases = [lease for lease in self._leases if lease[1] > now]
            published = self._snapshot is not None and self._snapshot.flat.data_ptr() == flat.data_ptr()
            lent = [ptr for ptr, _ in self._in_flight] + [ptr for ptr, _, _ in self._leases]
            return published or flat.data_ptr() in lent

    def untold(self, window_s: float = 120.0) -> int:
        """Samplers heard from in the last `window_s` that have not yet been told the run finished."""
        with self._lock:
            now = time.monotonic()
            return sum(
                1 for who, t in self._seen.items() if now - t < window_s and who not in self._told_finished
            )

    def set_status(self, **changes) -> None:
        """Change fields of the status samplers see (`TrainerStatus`: starved, finished, schedule)."""
        with self._lock:
            old = self._status
            self._status = replace(old, **changes)
            changed = self._status != old
        if changed:
            self._wake_out.send(b"")

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._wake_out.send(b"")
        self._thread.join(timeout=10)
        self._wake_out.close()
        if self._own_context:
            self._context.term()

    # --- server thread
    def _serve(self) -> None:
        waiters: list[tuple[bytes, str, int, str | None, float]] = []
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        try:
            while not self._stop:
                timeout = min((w[4] for w in waiters), default=time.monotonic() + 1.0)
                events = dict(poller.poll(max(0, int((timeout - time.monotonic()) * 1000)) + 1))
                if self._wake_in in events:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                while self._router.poll(0):
                    request = self._receive()
                    try:
                        if request is not None:
                            waiters += self._handle(*request)
                    except Exception:  # a bug here must not stop weight sync for every sampler
                        self.dropped["error"] += 1
                        log.exception("weight server failed on a request; dropped it")
                waiters = self._answer_waiters(waiters)
        finally:
            self._router.close()
            self._wake_in.close()

    def _receive(self) -> tuple[bytes, str, dict] | None:
        frames = self._router.recv_multipart(copy=False)
        identity, body = frames[0].bytes, frames[1:]
        try:
            kind, payload = decode_control(body, max_bytes=MAX_REQUEST_BYTES)
            if kind not in ("status", "fetch", "release") or not isinstance(payload.get("request"), str):
                raise WireError(f"unknown request {kind!r}")
        except WireError as err:
            self.dropped[err.reason] += 1
            log.warning("weight server dropped a request (%d so far): %s", sum(self.dropped.values()), err)
            return None
        with self._lock:
            self._seen[identity] = time.monotonic()
        return identity, kind, payload

    def _handle(self, identity: bytes, kind: str, payload: dict) -> list:
        request = payload["request"]
        if kind == "release":  # a borrower finished loading: its leased buffers may be reused
            with self._lock:
                self._leases = [lease for lease in self._leases if lease[2] != identity]
            return []
        with self._lock:
            snapshot, status = self._snapshot, self._status
        if kind == "fetch":
            if snapshot is None:
                self._reply(identity, request, status)
            elif payload.get("shared") is True and snapshot.path is not None:
                self._lend_snapshot(identity, request, snapshot)
            else:
                self._send_snapshot(identity, request, snapshot)
            return []
        newer_than, run_id = payload.get("newer_than"), payload.get("run_id")
        wait_s = payload.get("wait_s", 0.0)
        wait_s = min(float(wait_s), 60.0) if isinstance(wait_s, (int, float)) and wait_s > 0 else 0.0
        if wait_s and isinstance(newer_than, int) and not _is_news(status, newer_than, run_id):
            return [(identity, request, newer_than, run_id, time.monotonic() + wait_s)]
        self._reply(identity, request, status)
        return []

    def _forget_departed(self, status: TrainerStatus) -> None:
        """Once finished, drop samplers that have gone away from `_seen`: a reply to a departed
        peer is unroutable (ROUTER_MANDATORY). Live ones ignore it (no request of theirs)."""
        now = time.monotonic()
        if not status.finished or now - self._last_probe < 1.0:
            return
        self._last_probe = now
        with self._lock:
            untold = [who for who in self._seen if who not in self._told_finished]
        for who in untold:
            if not self._send(who, encode_control("status", {"request": "", **status_payload(status)})):
                with self._lock:
                    self._seen.pop(who, None)

    def _answer_waiters(self, waiters: list) -> list:
        with self._lock:
            status = self._status
        self._forget_departed(status)
        now, still = time.monotonic(), []
        for identity, request, newer_than, run_id, deadline in waiters:
            if now >= deadline or _is_news(status, newer_than, run_id):
                self._reply(identity, request, status)
            else:
                still.append((identity, request, newer_than, run_id, deadline))
        return still

    def _send(self, identity: bytes, frames: list, track: bool = False) -> zmq.MessageTracker | bool:
        try:
            tracker = self._router.send_multipart(
                [identity, *frames], flags=zmq.DONTWAIT, copy=False, track=track
            )
            return tracker if track else True
        except zmq.ZMQError as err:  # EHOSTUNREACH: the sampler left; EAGAIN: it stopped reading
            self.dropped["unroutable"] += 1
            log.debug("weight server could not reply to a sampler: %s", err)
            return False

    def _reply(self, identity: bytes, request: str, status: TrainerStatus) -> None:
        if status.finished:  # marked before sending: the sampler may act on it at once
            with self._lock:
                self._told_finished.add(identity)
        self.served["status"] += 1
        if not self._send(identity, encode_control("status", {"request": request, **status_payload(status)})):
            with self._lock:
                self._told_finished.discard(identity)

    def _lend_snapshot(self, identity: bytes, request: str, snapshot: Snapshot) -> None:
        """Tell a same-host sampler which file holds the snapshot; the buffer is not reused until
        the lease ends (the sampler checks it finished loading before then)."""
        until = time.monotonic() + LEASE_S
        with self._lock:
            self._leases.append((snapshot.flat.data_ptr(), until, identity))
        payload = {
            "request": request,
            "path": snapshot.path,
            "lease_until": until,
            "manifest": manifest_to_json(snapshot.manifest),
        }
        # counted before the reply leaves: a sampler that has it may read the count at once
        self.served["shared"] += 1
        if not self._send(identity, encode_control("shared", payload)):
            self.served["shared"] -= 1

    def _send_snapshot(self, identity: bytes, request: str, snapshot: Snapshot) -> None:
        snapshot = snapshot.hashed()  # once per version, in this thread, for the first chunk fetch
        address = snapshot.flat.data_ptr()
        last = len(snapshot.manifest.chunks) - 1
        for index in range(last + 1):
            frames = encode_weights_chunk(snapshot.manifest, index, snapshot.chunk(index), request=request)
            if index == last:  # counted before the last chunk leaves, as in _lend_snapshot
                self.served["fetch"] += 1
            tracker = self._send(identity, frames, track=True)  # the chunk is the last frame
            if not tracker:
                if index == last:
                    self.served["fetch"] -= 1
                return
            with self._lock:
                self._in_flight.append((address, tracker))


def _is_news(status: TrainerStatus, newer_than: int, run_id: str | None) -> bool:
    return status.finished or status.version > newer_than or (run_id is not None and status.run_id != run_id)


def status_payload(status: TrainerStatus) -> dict:
    return {
        "version": status.version,
        "run_id": status.run_id,
        "starved": status.starved,
        "finished": status.finished,
        "batches": status.batches,
        "take_versions": list(status.take_versions),
    }


def status_from_payload(payload: dict) -> TrainerStatus:
    try:
        takes = payload.get("take_versions", [])
        status = TrainerStatus(
            version=payload["version"],
            run_id=payload["run_id"],
            starved=payload["starved"],
            finished=payload["finished"],
            batches=payload.get("batches", 0),
            take_versions=tuple(takes) if isinstance(takes, list) and len(takes) <= 1024 else None,
        )
    except (KeyError, TypeError, AttributeError) as err:
        raise WireError(f"malformed trainer status: {err}") from err
    ok = isinstance(status.version, int) and isinstance(status.run_id, str)
    ok = ok and isinstance(status.starved, bool) and isinstance(status.finished, bool)
    ok = ok and isinstance(status.batches, int) and isinstance(status.take_versions, tuple)
    if not (ok and all(type(v) is int for v in status.take_versions)):
        raise WireError(f"malformed trainer status: {payload!r:.200}")
    return status


class WeightClient:
    """Sampler side of the `zmq` method: asks the trainer's `WeightServer` for status and weights.

    Every request carries a fresh id and replies with another id are discarded, so a reply that
    arrives after its request timed out (a trainer that was busy or restarted) is harmless. A
    trainer that refuses this client's handshake (CURVE keys that do not match) answers nothing;
    `handshake_problem()` then says why, and the client tries again until the keys match.
    """

    def __init__(
        self,
        address: str,
        *,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
        max_chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.address = address
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_chunk_bytes + MAX_REQUEST_BYTES)
        self._max_bytes = max_chunk_bytes + MAX_REQUEST_BYTES
        self._handshakes: HandshakeWatch | None = None
        try:
            configure_client(self._socket, curve or CurveConfig())
            self._handshakes = HandshakeWatch(self._socket, address, curve or CurveConfig())
            self._socket.connect(address)
        except Exception:
            self.close()
            raise
        self._flat: torch.Tensor | None = None
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # lent files by (device, inode), oldest first
        self.lease_until: float | None = None

    def handshake_problem(self) -> str | None:
        """Why the trainer refuses this client's handshakes (see auth.HandshakeWatch); None while
        they succeed."""
        return self._handshakes.check()

    def _request(self, kind: str, payload: dict, deadline: float) -> str | None:
        """Send a request; its id, or None when it could not leave by `deadline` (a refused
        connection that ZeroMQ dropped leaves a DEALER nowhere to send, until it reconnects)."""
        request = uuid.uuid4().hex
        frames = encode_control(kind, {"request": request, **payload})
        while True:
            try:
                self._socket.send_multipart(frames, flags=zmq.DONTWAIT)
                return request
            except zmq.Again:
                pass
            if not self._wait(zmq.POLLOUT, deadline):
                return None

    def _wait(self, event: int, deadline: float) -> bool:
        """Poll for `event` until `deadline`, reading the handshake events meanwhile."""
        while True:
            self._handshakes.check()  # reconnects after a refused handshake
            remaining = deadline - time.monotonic()
            if self._socket.poll(max(0, int(min(remaining, POLL_SLICE_S) * 1000)), event):
                return True
            # refused: no answer is coming; the caller says why (`handshake_problem`) and asks again
            if remaining <= POLL_SLICE_S or self._handshakes.problem is not None:
                return False

    def _next_frame(self, deadline: float) -> zmq.Frame | None:
        if not self._wait(zmq.POLLIN, deadline):
            return None
        return self._socket.recv(copy=False)

    def _drain_message(self) -> None:
        while self._socket.getsockopt(zmq.RCVMORE):
            self._socket.recv(copy=False)

    def status(
        self,
        *,
        newer_than: int | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 5.0,
    ) -> TrainerStatus | None:
        """The trainer's status; with `newer_than`, waits up to `wait_s` for a newer version.
        None when the trainer did not answer within wait_s + timeout_s."""
        payload = {"newer_than": newer_than, "run_id": run_id, "wait_s": wait_s}
        deadline = time.monotonic() + wait_s + timeout_s
        request = self._request("status", payload, deadline)
        while request is not None and (frame := self._next_frame(deadline)) is not None:
            status = self._status_reply(frame, request)
            if status is not None:
                return status
        return None

    def _status_reply(self, frame: zmq.Frame, request: str) -> TrainerStatus | None:
        if self._socket.getsockopt(zmq.RCVMORE):  # a chunk of an abandoned fetch
            self._drain_message()
            return None
        try:
            kind, payload = decode_control([frame], max_bytes=self._max_bytes)
            if kind != "status" or payload.get("request") != request:
                return None
            return status_from_payload(payload)
        except WireError as err:
            log.warning("ignored a malformed reply from the trainer: %s", err)
            return None

    def fetch(
        self, *, timeout_s: float = 60.0, shared: bool = False
    ) -> tuple[WeightsManifest, torch.Tensor] | None:
        """The newest version (manifest, flat buffer); None if the trainer has none yet or is silent
        for `timeout_s` (counted from the request and again from each frame received, so a large
        snapshot may take longer in all, while a request lost to a trainer that died costs only
        `timeout_s`). The buffer is reused between fetches: apply it (load_weights) before fetching again.

        `shared` (a sampler on the trainer's host): ask to be lent the trainer's shared snapshot
        instead of its chunks; the buffer returned then maps the trainer's file, and `lease_held()`
        must still be true once it is loaded (otherwise fetch again without `shared`)."""
        deadline = time.monotonic() + timeout_s
        request = self._request("fetch", {"shared": True} if shared else {}, deadline)
        manifest, received = None, 0
        self.lease_until = None
        while request is not None and (frame := self._next_frame(deadline)) is not None:
            if not self._socket.getsockopt(zmq.RCVMORE):  # one frame: a status (no weights yet) or a loan
                kind, payload = self._control_reply(frame, request)
                if kind == "shared":
                    return self._map_lent(payload)
                if kind == "status":
                    return None
                continue
            try:
                header = decode_weights_header(frame, max_bytes=self._max_bytes)
            except WireError as err:
                self._drain_message()
                raise WeightSyncError(f"malformed weights chunk from the trainer: {err}") from err
            if header["request"] != request:
                self._drain_message()
                continue
            if header["index"] == 0:
                manifest, received = header["manifest"], 0
                if self._flat is None or self._flat.numel() != manifest.total_bytes:
                    self._flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
            if manifest is None or header["index"] != received:
                self._drain_message()
                raise WeightSyncError(f"weights chunk {header['index']} arrived out of order")
            self._receive_chunk(manifest, header)
            received += 1
            deadline = time.monotonic() + timeout_s
            if received == len(manifest.chunks):
                return manifest, self._flat
        return None

    def lease_held(self) -> bool:
        """After loading a lent snapshot: whether the trainer still guaranteed it unchanged."""
        return self.lease_until is None or time.monotonic() < self.lease_until

    def release(self) -> None:
        """Done with a lent snapshot: the trainer may overwrite its buffer now (no reply)."""
        if self.lease_until is not None:
            self._request("release", {}, time.monotonic() + 1.0)  # if lost, the lease runs out
            self.lease_until = None

    def _control_reply(self, frame: zmq.Frame, request: str) -> tuple[str | None, dict]:
        try:
            kind, payload = decode_control([frame], max_bytes=self._max_bytes)
        except WireError as err:
            log.warning("ignored a malformed reply from the trainer: %s", err)
            return None, {}
        if payload.get("request") != request:
            return None, {}
        return kind, payload

    def _map_lent(self, payload: dict) -> tuple[WeightsManifest, torch.Tensor] | None:
        """Map the lent snapshot file read-only (mappings of recent files are kept: a fresh one
        faults its pages in again)."""
        try:
            manifest = manifest_from_json(payload.get("manifest"))
            path, until = payload.get("path"), payload.get("lease_until")
            if not (isinstance(path, str) and _SHARED_FILE.fullmatch(path) and isinstance(until, float)):
                raise WireError(f"malformed loan: {path!r:.100}, {until!r}")
        except WireError as err:
            raise WeightSyncError(f"malformed shared snapshot from the trainer: {err}") from err
        self.lease_until = until
        try:
            info = os.stat(path)  # the file itself: an fd number is reused once the trainer closes it
            key = (info.st_dev, info.st_ino)
            flat = self._mapped.get(key)
            if flat is None or flat.numel() != manifest.total_bytes:
                array = np.memmap(path, dtype=np.uint8, mode="r", shape=(manifest.total_bytes,))
                with warnings.catch_warnings():  # read-only on purpose: torch warns about that
                    warnings.simplefilter("ignore")
                    flat = torch.from_numpy(array)
                self._mapped[key] = flat
                while len(self._mapped) > 4:
                    self._mapped.pop(next(iter(self._mapped)))
        except (OSError, ValueError) as err:  # gone, not ours to open, or another size: fetch chunks
            log.info("weights: cannot map %s (%s); fetching chunks", path, err)
            self.lease_until = 0.0
            return None
        return manifest, flat

    def _receive_chunk(self, manifest: WeightsManifest, header: dict) -> None:
        offset, nbytes, digest = manifest.chunks[header["index"]]
        if (header["offset"], header["nbytes"], header["hash"]) != (offset, nbytes, digest):
            self._drain_message()
            raise WeightSyncError(f"weights chunk {header['index']} disagrees with the manifest")
        target = memoryview(self._flat.numpy())[offset : offset + nbytes]
        size = self._socket.recv_into(target)  # straight into the buffer: no intermediate copy
        if size != nbytes:
            raise WeightSyncError(f"weights chunk {header['index']} has {size} bytes, expected {nbytes}")
        if _hash(target) != digest:
            raise WeightSyncError(f"weights v{manifest.version}: chunk {header['index']} fails its checksum")

    def close(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
        self._socket.close()
        if self._own_context:
            self._context.term()


# ----------------------------------------------------------------------------- fs method

STATUS_FILE = "status.json"


def _version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def list_versions(root: Path) -> list[tuple[int, Path]]:
    """Complete versions, oldest first (temporary folders of an interrupted write are ignored)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if name.startswith("v") and name[1:].isdigit() and (path / "manifest.json").is_file():
            found.append((int(name[1:]), path))
    return sorted(found)


class FsWeightWriter:
    """Trainer side of the `fs` method: versions as folders, written atomically, old ones pruned."""

    def __init__(self, root: str | Path, *, run_id: str, keep: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._status = TrainerStatus(version=-1, run_id=run_id)
        self._write_status()

    def publish(self, snapshot: Snapshot) -> None:
        snapshot = snapshot.hashed()  # readers check every chunk

        def write(tmp: Path) -> None:
            with open(tmp / "weights.bin", "wb") as f:
                f.write(memoryview(snapshot.flat.numpy()))
            (tmp / "manifest.json").write_text(json.dumps(manifest_to_json(snapshot.manifest)))

        atomic_dir(_version_dir(self.root, snapshot.manifest.version), write)
        self._prune(self.keep)
        self._status = replace(self._status, version=snapshot.manifest.version)
        self._write_status()

    def _prune(self, keep: int) -> int:
        """Remove all but the newest `keep` versions; returns the bytes freed. A sampler may be
        reading a pruned version: its open file stays readable until closed (POSIX)."""
        freed = 0
        for _, path in list_versions(self.root)[: len(list_versions(self.root)) - keep]:
            for file in path.iterdir():
                freed += file.stat().st_size
                file.unlink(missing_ok=True)
            path.rmdir()
        return freed

    def busy(self, flat: torch.Tensor) -> bool:
        return False  # published versions are files: the buffer is free once publish returns

    def untold(self, window_s: float = 120.0) -> int:
        return 0  # status.json stays behind: a sampler reads "finished" whenever it looks

    def set_status(self, **changes) -> None:
        old = self._status
        self._status = replace(old, **changes)
        if self._status != old:
            self._write_status()

    def _write_status(self) -> None:
        atomic_write_text(self.root / STATUS_FILE, json.dumps(status_payload(self._status)), fsync=False)

    def close(self) -> None:
        """A finished run's versions go too (its samplers have heard it is over, and the trained
        model is in final/); status.json stays and says so. An interrupted run keeps its newest
        versions for the samplers that outlive it."""
        if self._status.finished:
            freed = self._prune(0)
            if freed:
                log.info("removed the published weight versions from %s (%.2f GB)", self.root, freed / 1e9)


class FsWeightReader:
    """Sampler side of the `fs` method (the folder may be shared between hosts, e.g. over NFS)."""

    POLL_S = 0.05

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._flat: torch.Tensor | None = None

    def _read_status(self) -> TrainerStatus | None:
        try:
            return status_from_payload(json.loads((self.root / STATUS_FILE).read_text()))
        except (FileNotFoundError, json.JSONDecodeError, WireError):
            return None

    def status(
        self,
        *,
        newer_than: int | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 5.0,
    ) -> TrainerStatus | None:
        deadline = time.monotonic() + wait_s
        while True:
            status = self._read_status()
            done = newer_than is None or (status is not None and _is_news(status, newer_than, run_id))
            if done or time.monotonic() >= deadline:
                return status
            time.sleep(self.POLL_S)

    def fetch(self, *, timeout_s: float = 60.0) -> tuple[WeightsManifest, torch.Tensor] | None:
        for _ in range(5):  # the newest version may be pruned under our feet: take the next newest
            versions = list_versions(self.root)
            if not versions:
                return None
            try:
                return self._read(versions[-1][1])
            except FileNotFoundError:
                continue
        return None

    def _read(self, path: Path) -> tuple[WeightsManifest, torch.Tensor]:
        try:
            manifest = manifest_from_json(json.loads((path / "manifest.json").read_text()))
        except (json.JSONDecodeError, WireError) as err:
            raise WeightSyncError(f"{path}/manifest.json is malformed: {err}") from err
        if self._flat is None or self._flat.numel() != manifest.total_bytes:
            self._flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
        with open(path / "weights.bin", "rb") as f:
            size = f.readinto(memoryview(self._flat.numpy()))
            if size != manifest.total_bytes or f.read(1):
                raise WeightSyncError(f"{path}/weights.bin does not have {manifest.total_bytes} bytes")
        verify_chunks(self._flat, manifest)
        return manifest, self._flat

    def handshake_problem(self) -> str | None:
        return None  # files: no handshake

    def close(self) -> None:
        pass
