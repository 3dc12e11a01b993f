"""Trainer side of the `zmq` weight-sync method: `WeightServer`, a ROUTER on the sync port driven by
one background thread, serves the newest snapshot's chunks straight from memory and the trainer's
status. Snapshots live in (unlinked) /dev/shm files, so a sampler on the trainer's host (one that
reached it over the ipc twin, `local_sync_address`) is instead lent the snapshot itself; the lease
says until when the trainer leaves that buffer alone.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
import zmq

from tandem.config import CurveConfig
from tandem.transport.auth import CountingAuthenticator, configure_server
from tandem.transport.drops import Drops
from tandem.transport.weights.snapshot import Snapshot, SnapshotBuffers, is_news
from tandem.transport.wire import (
    WireError,
    decode_control,
    encode_control,
    encode_weights_chunk,
    manifest_to_json,
    status_to_json,
)
from tandem.types import TrainerStatus, WeightsManifest

log = logging.getLogger(__name__)

DEFAULT_SYNC_PORT = 5556
LEASE_S = 10.0  # how long a lent shared snapshot stays untouched (a load takes well under a second)
MAX_REQUEST_BYTES = 64 * 2**10
MAX_REQUEST_ID_CHARS = 128
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

    It is a `WeightPublisher`: `publish_version` snapshots tensors into its own buffers (shared
    files under `shared_prefix`, lent to same-host samplers, when given) and serves them; `publish`
    serves a snapshot taken elsewhere.
    """

    def __init__(
        self,
        address: str,
        *,
        run_id: str,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
        auth: CountingAuthenticator | None = None,
        shared_prefix: str | None = None,
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
        self.where = self.address
        self.run_id = run_id
        self._buffers = SnapshotBuffers(shared_prefix=shared_prefix)
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
        self._drops = Drops(log, f"the weight server {self.address}")
        self.dropped: Counter[str] = self._drops.counts
        self.served: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._serve, name="tandem-weight-server", daemon=True)
        self._thread.start()

    # --- main thread
    def publish_version(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, dtype: str | None = None
    ) -> WeightsManifest:
        """Snapshot `named_tensors` as `version` into a buffer no fetch reads any more, and serve it."""
        snapshot = self._buffers.snapshot(
            named_tensors,
            publisher=self,
            version=version,
            run_id=self.run_id,
            dtype=dtype,
            hashed=False,  # hashed here when a sampler fetches chunks (a lent snapshot never needs it)
        )
        self.publish(snapshot)
        return snapshot.manifest

    def stats(self) -> dict[str, int]:
        """Versions lent as shared files (same host) and sent as chunks, and requests dropped
        (malformed, or a lend asked for from another host), so far."""
        dropped = sum(n for reason, n in self.dropped.items() if reason != "unroutable")
        return {
            "weights_lent": self.served["shared"],
            "weights_sent": self.served["fetch"],
            "weight_requests_dropped": dropped,
        }

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
        self._buffers.close()
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
                    except Exception as err:  # a bug here must not stop weight sync for every sampler
                        self._drops.add("error", repr(err)[:200])
                waiters = self._answer_waiters(waiters)
        finally:
            self._router.close()
            self._wake_in.close()

    def _receive(self) -> tuple[bytes, str, dict, bool] | None:
        frames = self._router.recv_multipart(copy=False)
        identity, body = frames[0].bytes, frames[1:]
        try:
            kind, payload = decode_control(body, max_bytes=MAX_REQUEST_BYTES)
            if kind not in ("status", "fetch", "release"):
                raise WireError(f"unknown request {kind[:40]!r}")
            _check_request_id(payload.get("request"))
        except WireError as err:
            self._drops.add(err.reason, str(err))
            return None
        with self._lock:
            self._seen[identity] = time.monotonic()
        return identity, kind, payload, _same_host(body[0] if body else None)

    def _handle(self, identity: bytes, kind: str, payload: dict, same_host: bool) -> list:
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
            elif payload.get("shared") is True and snapshot.path is not None and same_host:
                self._lend_snapshot(identity, request, snapshot)
            else:
                if payload.get("shared") is True and not same_host:  # the memory file is this host's
                    self.served["lend_refused"] += 1  # to a peer elsewhere: chunks, no lease to pin
                self._send_snapshot(identity, request, snapshot)
            return []
        newer_than, run_id = payload.get("newer_than"), payload.get("run_id")
        wait_s = payload.get("wait_s", 0.0)
        wait_s = min(float(wait_s), 60.0) if isinstance(wait_s, (int, float)) and wait_s > 0 else 0.0
        if wait_s and isinstance(newer_than, int) and not is_news(status, newer_than, run_id):
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
            if not self._send(who, encode_control("status", {"request": "", **status_to_json(status)})):
                with self._lock:
                    self._seen.pop(who, None)

    def _answer_waiters(self, waiters: list) -> list:
        with self._lock:
            status = self._status
        self._forget_departed(status)
        now, still = time.monotonic(), []
        for identity, request, newer_than, run_id, deadline in waiters:
            if now >= deadline or is_news(status, newer_than, run_id):
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
        if not self._send(identity, encode_control("status", {"request": request, **status_to_json(status)})):
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


def _check_request_id(request: object) -> None:
    """A request id is echoed in the reply: a short str that UTF-8 can carry."""
    if not isinstance(request, str) or len(request) > MAX_REQUEST_ID_CHARS:
        raise WireError(
            f"request id must be a str of at most {MAX_REQUEST_ID_CHARS} characters", "bad_request"
        )
    try:
        request.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError("request id is not valid UTF-8 (a lone surrogate)", "bad_request") from None


def _same_host(frame: zmq.Frame | None) -> bool:
    """Whether a request came from this host: over the ipc twin (a Unix socket) or loopback TCP.
    ZeroMQ reports the sender's address as the frame's Peer-Address (an IP for TCP)."""
    if frame is None:
        return False
    try:
        peer = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return False
    try:
        return ipaddress.ip_address(peer.removeprefix("::ffff:")).is_loopback
    except ValueError:  # not an IP: a Unix socket, which only this host can reach
        return bool(peer)
