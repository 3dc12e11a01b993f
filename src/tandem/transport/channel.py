"""The experience channel: samplers PUSH groups to the trainer's PULL socket (default port 5555).

The trainer binds (`GroupReceiver`), samplers connect (`GroupSender`); bytes are `wire.py`'s.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import time
from collections import Counter, deque

import zmq

from tandem.config import CurveConfig
from tandem.transport.admission import GroupLimits, check_group
from tandem.transport.auth import CountingAuthenticator, HandshakeWatch, configure_client, configure_server
from tandem.transport.drops import Drops
from tandem.transport.wire import (
    EVAL_KIND,
    MAX_GROUP_FRAMES,
    MAX_MESSAGE_BYTES,
    WireError,
    check_eval,
    decode_control,
    decode_group,
    encode_eval,
    encode_group,
)
from tandem.types import Group

DEFAULT_DATA_PORT = 5555
MAX_SAMPLER_KEYS = 64  # sampler ids counted by name in `received`; the rest count as "other"
MAX_PENDING_EVALS = 16  # held-out evaluations kept until the trainer logs them
POLL_SLICE_S = 0.25  # a blocked sender looks at its handshakes this often

logger = logging.getLogger(__name__)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and tools; another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _remaining_ms(deadline: float | None) -> int | None:
    return None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))


class GroupSender:
    """Sampler side: a PUSH socket that connects to the trainer's `GroupReceiver`.

    Delivery guarantees:
    - Pattern: PUSH (sampler, connects) -> PULL (trainer, binds); many samplers may fan in to one
      trainer. Groups from one sender arrive in the order they were sent; groups of different
      senders interleave.
    - Backpressure, never loss: at most `sndhwm` groups wait in this socket (plus the trainer's
      `rcvhwm` and whatever the OS socket buffers hold). When they are full, `send` blocks, so
      a slow trainer makes a fast sampler wait; with `timeout` it raises `TimeoutError` instead.
      Nothing is dropped silently. Before the trainer is up, groups queue up to `sndhwm` and
      then `send` blocks until it connects.
    - A group in flight when the trainer dies is lost. That is harmless: the sampler keeps
      producing, every group records its `policy_version`, and the trainer's staleness filter
      drops groups that are too old once it is back (DESIGN.md section 4).
    - A trainer that refuses this sampler's handshake (CURVE keys that do not match) receives
      nothing: `send` blocks (or times out) and `handshake_problem()` says why; the sender tries
      again every second until the keys match.
    - `close()` waits at most `linger` seconds for queued groups to leave, then discards them.
    - Array frames are sent zero-copy: do not modify a group's log-prob tensors after `send`.
    - Like every ZeroMQ socket, a sender belongs to one thread.
    """

    def __init__(
        self,
        address: str = f"tcp://127.0.0.1:{DEFAULT_DATA_PORT}",
        *,
        sndhwm: int = 4,
        linger: float = 1.0,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
    ):
        if sndhwm < 1:
            raise ValueError(f"sndhwm must be >= 1 (0 would mean an unbounded queue), got {sndhwm}")
        self.address = address
        self.sndhwm = sndhwm
        self._own_context = context is None
        self._context = zmq.Context(io_threads=1) if context is None else context
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, sndhwm)
        self._socket.setsockopt(zmq.LINGER, int(linger * 1000))
        self._handshakes: HandshakeWatch | None = None
        try:
            configure_client(self._socket, curve or CurveConfig())
        except Exception:
            self.close()
            raise
        self._handshakes = HandshakeWatch(self._socket, address, curve or CurveConfig())
        try:
            self._socket.connect(address)
        except zmq.ZMQError as err:
            self.close()
            raise ValueError(
                f"cannot connect to {address!r}: {err} (expected tcp://host:port or ipc://path)"
            ) from err
        self._closed = False

    def send(self, group: Group, timeout: float | None = None) -> None:
        """Queue one group for the trainer; blocks while the high-water mark is reached.

        Raises `TimeoutError` if the group could not be queued within `timeout` seconds (None:
        wait forever); the group was then not sent and may be retried. A group that cannot be
        encoded raises `WireError` before anything is sent.
        """
        self._send_frames(encode_group(group), timeout, f"group {group.group_id}")

    def _send_frames(self, frames: list, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            refused = self._handshakes.check() is not None  # (and reconnects after a refusal)
            wait_ms = int(POLL_SLICE_S * 1000)
            if deadline is not None:
                wait_ms = min(wait_ms, _remaining_ms(deadline))
            if refused:  # a group queued now would be lost with the refused connection: hold it
                self._handshakes.wait(wait_ms)
            elif self._socket.poll(wait_ms, zmq.POLLOUT):
                try:
                    # a multipart message is atomic: once the first frame is queued, all are
                    self._socket.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
                    return
                except zmq.Again:
                    pass
            if deadline is not None and time.monotonic() >= deadline:
                why = self.handshake_problem() or (
                    f"the trainer is not receiving (high-water mark of {self.sndhwm} group(s) reached)"
                )
                raise TimeoutError(f"{what} not queued to {self.address} within {timeout}s: {why}")

    def send_eval(
        self, sampler_id: str, policy_version: int, fields: dict, timeout: float | None = None
    ) -> None:
        """Queue a held-out evaluation (wire.encode_eval) for the trainer; TimeoutError as `send`."""
        self._send_frames(
            encode_eval(sampler_id, policy_version, fields), timeout, f"eval of version {policy_version}"
        )

    def handshake_problem(self) -> str | None:
        """Why the trainer refuses this sender's handshakes (CURVE keys, see auth.HandshakeWatch);
        None while they succeed."""
        return self._handshakes.check()

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self._handshakes is not None:
            self._handshakes.close()
        self._socket.close()
        if self._own_context:
            self._context.term()  # waits up to `linger` for queued groups to be delivered

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class GroupReceiver:
    """Trainer side: a PULL socket that binds and yields validated `Group`s.

    Messages larger than `max_bytes` per frame are refused by ZeroMQ itself (ZMQ_MAXMSGSIZE),
    which also drops that peer's connection; anything else that fails `decode_group` is dropped,
    logged and counted in `dropped` by reason ("bad_header", "schema", "size", "frames",
    "invalid"). With `limits`, a well-formed group the run cannot train on (`admission.check_group`)
    is dropped the same way and counted in `rejected` by its reason. Warnings are rate-limited
    (`drops.Drops`). `received` counts accepted groups per sampler_id (the first MAX_SAMPLER_KEYS
    ids by name, later ones as "other"). `recv` never raises on bad input. At most `rcvhwm` groups per connected sampler wait here before senders block. With
    CURVE, `auth` (the context's `CountingAuthenticator`) counts the handshakes it refuses.
    """

    def __init__(
        self,
        address: str = f"tcp://*:{DEFAULT_DATA_PORT}",
        *,
        max_bytes: int = MAX_MESSAGE_BYTES,
        rcvhwm: int = 8,
        context: zmq.Context | None = None,
        curve: CurveConfig | None = None,
        auth: CountingAuthenticator | None = None,
        limits: GroupLimits | None = None,
    ):
        if rcvhwm < 1:
            raise ValueError(f"rcvhwm must be >= 1 (0 would mean an unbounded queue), got {rcvhwm}")
        self.max_bytes, self.limits = max_bytes, limits
        # a group: header, prompt ids, and up to 4 arrays per completion (tokens, old and reference
        # log-probs, an episode's policy mask)
        self._max_frames = 2 + 4 * limits.num_generations if limits is not None else MAX_GROUP_FRAMES
        self._drops, self._rejections = Drops(logger, address), Drops(logger, address)
        self.dropped: Counter[str] = self._drops.counts  # malformed messages, by WireError reason
        self.rejected: Counter[str] = self._rejections.counts  # well-formed groups the run cannot use
        self.received: Counter[str] = Counter()
        self.evals: deque[dict] = deque(maxlen=MAX_PENDING_EVALS)  # samplers' evaluations, oldest first
        self._own_context = context is None
        self._context = zmq.Context(io_threads=1) if context is None else context
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            configure_server(self._socket, curve or CurveConfig(), auth)
        except Exception:
            self.close()
            raise
        try:
            self._socket.bind(address)
        except zmq.ZMQError as err:
            self.close()
            if err.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"cannot bind the experience channel to {address}: address already in use "
                    f"(is another trainer running?); choose another port, e.g. {free_tcp_port()}",
                ) from err
            raise ValueError(
                f"cannot bind to {address!r}: {err} (expected tcp://*:port or ipc://path)"
            ) from err
        self.address = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()  # resolves port 0 / '*'
        self._drops.where = self._rejections.where = self.address
        # connections ZeroMQ closed: an oversize frame (MAXMSGSIZE), a protocol error, or a sampler
        # that left. A socket has one monitor: with CURVE it is the authenticator's, which counts them.
        self._closures = Drops(logger, self.address)
        self._auth = auth if curve is not None and curve.enabled else None
        self._monitor = (
            None if self._auth is not None else self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        )
        self._closed = False

    def recv(self, timeout: float | None) -> Group | None:
        """The next valid group, or None if none arrived within `timeout` seconds (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._count_closed()
        while self._socket.poll(_remaining_ms(deadline), zmq.POLLIN):
            frames = self._recv_parts()
            try:
                if frames is None:
                    raise WireError(f"message has more than {self._max_frames} frames", "frames")
                if len(frames) == 1:  # a control message: a sampler's held-out evaluation
                    self._eval(frames)
                    continue
                group = decode_group(frames, max_bytes=self.max_bytes)
            except WireError as err:
                self._drop(err.reason, str(err))
            except Exception as err:  # a bug in validation must not let a peer crash the trainer
                logger.exception("decoding a message failed unexpectedly; dropped")
                self._drop("error", repr(err))
            else:
                verdict = check_group(group, self.limits) if self.limits is not None else None
                if verdict is None:
                    known = group.sampler_id in self.received or len(self.received) < MAX_SAMPLER_KEYS
                    self.received[group.sampler_id if known else "other"] += 1
                    return group
                self._rejections.add(verdict[0], verdict[1])
            if deadline is not None and time.monotonic() >= deadline:
                break
        return None

    def _eval(self, frames) -> None:
        """Keep a valid `eval` message's payload in `evals` (the newest MAX_PENDING_EVALS); anything
        else in one frame raises WireError (dropped and counted by the caller)."""
        kind, payload = decode_control(frames, max_bytes=self.max_bytes)
        if kind != EVAL_KIND:
            raise WireError(f"control message of kind {kind!r} on the data channel", "schema")
        self.evals.append(check_eval(payload))

    @property
    def connections_closed(self) -> int:
        return self._closures.counts["connection closed"]

    def _count_closed(self) -> None:
        if self._auth is not None:  # CURVE: the authenticator's monitor of this socket counts them
            for _ in range(self._auth.closed[self.address] - self.connections_closed):
                self._closure()
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()
            self._closure()

    def _closure(self) -> None:
        self._closures.add(
            "connection closed",
            "ZeroMQ closed a peer's connection (a frame over pipeline.max_message_mb, a protocol "
            "error, or a sampler that left)",
        )

    def _recv_parts(self) -> list[zmq.Frame] | None:
        """One message, part by part; None (its parts read and let go) past the frame cap, so that
        200k empty parts cost no more than a few."""
        frames = [self._socket.recv(copy=False)]
        while self._socket.getsockopt(zmq.RCVMORE):
            part = self._socket.recv(copy=False)
            if frames is not None:
                frames.append(part)
                if len(frames) > self._max_frames:
                    frames = None
        return frames

    def _drop(self, reason: str, message: str) -> None:
        self._drops.add(reason, message)

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "_monitor", None) is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> GroupReceiver:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
