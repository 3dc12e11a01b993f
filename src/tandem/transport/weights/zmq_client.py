"""Sampler side of the `zmq` weight-sync method: `WeightClient`, a DEALER that asks the trainer's
`WeightServer` for status and weights (chunks received straight into its buffer and checked against
their hashes, or a lent shared snapshot mapped read-only), and `ZmqWeightSource`, the
`WeightSource` a sampler holds: it moves to the trainer's ipc twin once that answers as the same run,
and there borrows the trainer's snapshot instead of fetching its bytes.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
import warnings
from collections import Counter

import numpy as np
import torch
import zmq

from tandem.config import CurveConfig
from tandem.transport.auth import HandshakeWatch, configure_client
from tandem.transport.weights.snapshot import CHUNK_BYTES, WeightSyncError, chunk_hash, load_weights
from tandem.transport.weights.zmq_server import MAX_REQUEST_BYTES, sync_address
from tandem.transport.wire import (
    WireError,
    decode_control,
    decode_weights_header,
    encode_control,
    manifest_from_json,
    status_from_json,
)
from tandem.types import TrainerStatus, WeightsManifest

log = logging.getLogger(__name__)

POLL_SLICE_S = 0.25  # a waiting client looks at its handshakes this often
FETCH_IDLE_S = 30.0  # a sampler's weight fetch gives up after this long without a frame (then asks again)
_SHARED_FILE = re.compile(r"/proc/\d+/fd/\d+")  # how a trainer lends its (unlinked) snapshot file


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
        self.dropped: Counter[str] = Counter()  # malformed replies ignored, by WireError reason

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
            return status_from_json({key: value for key, value in payload.items() if key != "request"})
        except WireError as err:
            self.dropped[err.reason] += 1
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
            self.dropped[err.reason] += 1
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
        if chunk_hash(target) != digest:
            raise WeightSyncError(f"weights v{manifest.version}: chunk {header['index']} fails its checksum")

    def close(self) -> None:
        if self._handshakes is not None:
            self._handshakes.close()
        self._socket.close()
        if self._own_context:
            self._context.term()


class ZmqWeightSource:
    """A sampler's `WeightSource` for the `zmq` method: a `WeightClient` on the trainer's TCP address,
    moved to its ipc twin once that answers as the same run (a file left by a trainer that died is
    not trusted; TCP stays the fallback). Over the twin the trainer lends its snapshot file: no
    bytes sent, unless the loan fails or the load outlives its lease."""

    def __init__(self, host: str, port: int, *, context: zmq.Context, curve: CurveConfig) -> None:
        self._host, self._port, self._context, self._curve = host, port, context, curve
        self.client = WeightClient(
            f"tcp://{host}:{port}", context=context, curve=curve
        )  # ipc once it answers

    @property
    def where(self) -> str:
        return f"weights {self.client.address}"

    @property
    def same_host(self) -> bool:
        """Whether the trainer is reached over its ipc twin (on this host: it lends its snapshots)."""
        return self.client.address.startswith("ipc://")

    def status(
        self,
        *,
        newer_than: int | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 5.0,
    ) -> TrainerStatus | None:
        return self.client.status(newer_than=newer_than, run_id=run_id, wait_s=wait_s, timeout_s=timeout_s)

    def handshake_problem(self) -> str | None:
        return self.client.handshake_problem()

    def load_newest(
        self, policy: torch.nn.Module, params: dict[str, torch.Tensor] | None, status: TrainerStatus
    ) -> WeightsManifest | None:
        """Fetch the newest version and load it into `policy` (`params`: the tensors that travel);
        its manifest, or None when the trainer went away or has none. WeightSyncError: a bad reply."""
        self._prefer_local_socket(status)
        got = self.client.fetch(timeout_s=FETCH_IDLE_S, shared=True) if self.same_host else None
        if self.same_host and got is None and not self._same_trainer(status):
            return None  # the loan failed because its lender exited: a restarted trainer is next
        if got is not None:
            load_weights(policy, got[1], got[0], params)
            held = self.client.lease_held()
            self.client.release()  # the trainer may reuse that buffer now
            if not held:  # loaded too slowly: the file may have changed meanwhile
                log.warning("weights: a lent snapshot outlived its lease; fetching it again")
                got = None
        if got is None:
            got = self.client.fetch(timeout_s=FETCH_IDLE_S)
            if got is not None:
                load_weights(policy, got[1], got[0], params)
        return None if got is None else got[0]

    def _prefer_local_socket(self, status: TrainerStatus) -> None:
        if not self.client.address.startswith("tcp://"):
            return
        address = sync_address(self._host, self._port)
        if address == self.client.address:
            return
        local = WeightClient(address, context=self._context, curve=self._curve)
        answer = local.status(timeout_s=1.0)
        if answer is None or answer.run_id != status.run_id:
            local.close()
            return
        self.client.close()
        self.client = local

    def _same_trainer(self, status: TrainerStatus) -> bool:
        """Whether the trainer that sent `status` still answers (a request sent just as it died is
        lost, so this is asked before a chunk fetch that would otherwise wait FETCH_IDLE_S)."""
        answer = self.client.status(timeout_s=2.0)
        return answer is not None and answer.run_id == status.run_id

    def close(self) -> None:
        self.client.close()
