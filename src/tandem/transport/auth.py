"""Optional CURVE authentication and encryption of both channels (ZeroMQ's public-key security).

Turn it on whenever a port is reachable by anyone else: without it, whoever reaches port 5555 can
feed the trainer experience, and whoever reaches 5556 can read the weights. Keys come from
`tandem keygen DIR`; the trainer accepts only samplers whose public key lies in its
`authorized_clients` folder, and counts and logs every handshake it refuses. A refused sampler
says why (`HandshakeWatch`) and tries again, for as long as the keys do not match.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections import Counter
from contextlib import suppress
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from tandem.config import CurveConfig

log = logging.getLogger(__name__)

REFUSED_WARN_S = 30.0  # trainer: at most one warning per refused address (or failure kind) per this
RETRY_S = 1.0  # sampler: try again this long after a refusal (ZeroMQ itself never retries those)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH  # CURVE on one side only
_CRYPTO = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC  # the client encrypted for another server key


def keygen(directory: str | Path, names: list[str]) -> list[Path]:
    """Write NAME.key (public) and NAME.key_secret for each name, plus authorized/ with every
    name other than "trainer" (the folder the trainer's `authorized_clients` points to)."""
    directory = Path(directory)
    authorized = directory / "authorized"
    authorized.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        if (directory / f"{name}.key_secret").exists():
            raise FileExistsError(f"{directory / name}.key_secret exists; remove it or choose another name")
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
        if name != "trainer":
            shutil.copy(public, authorized / f"{name}.key")
    return written


def _load(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"CURVE key file {path} not found (make keys with `tandem keygen DIR`)")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise ValueError(f"{path} holds no secret key: give the .key_secret file, not the public .key")
    return public, secret_key


# ----------------------------------------------------------------------------- trainer side


class CountingAuthenticator(ThreadAuthenticator):
    """The ZAP handler of the trainer's context, which also watches the handshakes of the sockets
    it guards (`watch`). `refused` counts the handshakes the trainer turned down: keys outside
    authorized_clients (ZAP says from which address: `refused_from`) and CURVE protocol failures
    (a peer without CURVE, or with another server key; ZeroMQ does not say from where: `failed`).
    Each is logged, at most once per address (or kind) every REFUSED_WARN_S seconds."""

    def __init__(self, context: zmq.Context, authorized_clients: str = "") -> None:
        super().__init__(context)
        self.authorized_clients = authorized_clients
        self.refused_from: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.last_refused: float | None = None  # time.monotonic() of the latest one
        self._lock = threading.Lock()
        self._last_warning: dict[str, float] = {}
        self._addresses: dict[bytes, str] = {}  # ZAP request id -> the peer's address
        self._monitors: list[zmq.Socket] = []
        self.closed: Counter[str] = Counter()  # connections ZeroMQ closed, by the socket's endpoint
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def refused(self) -> int:
        with self._lock:
            return sum(self.refused_from.values()) + sum(self.failed.values())

    # --- ZAP (the authenticator's thread)
    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 4:  # version, request id, domain, address, ...: remember who asks
            self._addresses[msg[1]] = msg[3].decode(errors="replace")
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        address = self._addresses.pop(request_id, "an unknown address")
        if status_code != b"200":
            with self._lock:
                self.refused_from[address] += 1
                count = self.refused_from[address]
            self._warn(
                f"refused:{address}",
                "refused a CURVE handshake from %s (%d from there so far; %s): its key is not in "
                "pipeline.curve.authorized_clients (%s). A sampler with the wrong key? Its "
                "pipeline.curve.client_secret_key must pair with a public .key in that folder "
                "(make one with `tandem keygen`, then restart the trainer)",
                address,
                count,
                status_text.decode(errors="replace"),
                self.authorized_clients,
            )
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    # --- handshake monitors (a thread of their own)
    def watch(self, sock: zmq.Socket) -> None:
        """Count the failed CURVE handshakes of a trainer socket; call it from the socket's
        thread before the socket is handed to another (ZeroMQ sockets are not thread-safe)."""
        address = f"inproc://tandem-handshakes-{uuid.uuid4().hex}"
        # one monitor per socket: it also counts the connections ZeroMQ closes (an oversize frame,
        # a protocol error, a peer that left), which the socket's owner reads from `closed`
        events = (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED
        )
        sock.monitor(address, events)
        monitor = self.context.socket(zmq.PAIR)
        monitor.connect(address)
        with self._lock:  # the lock hands the new socket to the watcher thread
            self._monitors.append(monitor)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="tandem-handshakes", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        try:
            while not self._watching.is_set():
                poller = zmq.Poller()
                with self._lock:
                    for monitor in self._monitors:
                        poller.register(monitor, zmq.POLLIN)
                for monitor, _ in poller.poll(200):
                    while monitor.poll(0):
                        self._failed(parse_monitor_message(monitor.recv_multipart()))
        finally:
            with self._lock:
                for monitor in self._monitors:
                    monitor.close(linger=0)
                self._monitors = []

    def _failed(self, event: dict) -> None:
        endpoint = event["endpoint"].decode(errors="replace")
        if event["event"] == zmq.EVENT_DISCONNECTED:
            with self._lock:
                self.closed[endpoint] += 1
            return
        value = int(event["value"])
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # a peer without CURVE sees the mismatch as fast as we do and may hang up first
            kind = "hung up"
            why = "the peer hung up: a sampler without CURVE (or one that exited mid-handshake)?"
        elif value == _MISMATCH:
            kind = "no CURVE"
            why = (
                "a peer without CURVE: a sampler needs pipeline.curve.server_public_key and "
                "pipeline.curve.client_secret_key to reach this trainer"
            )
        elif value == _CRYPTO:
            kind = "another server key"
            why = (
                "a peer with another server key: a sampler's pipeline.curve.server_public_key must be "
                "this trainer's public .key (the pair of its pipeline.curve.server_secret_key)"
            )
        else:
            kind, why = f"protocol error {value:#x}", "is the peer a tandem sampler of this version?"
        with self._lock:
            self.failed[kind] += 1
            count = self.failed[kind]
        self._warn(
            f"failed:{kind}",
            "a handshake on %s failed (%s, %d so far; ZeroMQ does not say from where): %s",
            endpoint,
            kind,
            count,
            why,
        )

    def _warn(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            self.last_refused = now
            if now - self._last_warning.get(key, float("-inf")) < REFUSED_WARN_S:
                return
            self._last_warning[key] = now
        log.warning(message, *args)

    def summary(self) -> str | None:
        """The handshakes refused so far, in a few words (None: none), for the trainer's
        "no group has arrived" warning."""
        with self._lock:
            refused_from, failed, last = dict(self.refused_from), dict(self.failed), self.last_refused
        parts = []
        if refused_from:
            where = ", ".join(f"{a} ({n})" for a, n in sorted(refused_from.items(), key=lambda x: -x[1]))
            parts.append(
                f"{sum(refused_from.values())} handshakes refused from {where}: a sampler with the wrong "
                "key? (its public .key must be in pipeline.curve.authorized_clients)"
            )
        if failed:
            kinds = ", ".join(f"{k} ({n})" for k, n in sorted(failed.items(), key=lambda x: -x[1]))
            parts.append(
                f"{sum(failed.values())} handshakes failed: {kinds}: a sampler without pipeline.curve, or "
                "whose pipeline.curve.server_public_key is not this trainer's?"
            )
        if not parts:
            return None
        return "; ".join(parts) + f" (the last {time.monotonic() - last:.0f} s ago)"

    def stop(self) -> None:
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        super().stop()


def open_to_strangers(bind_host: str, curve: CurveConfig) -> str | None:
    """A warning when the trainer's ports take any peer that can reach this interface: bound
    beyond loopback with authentication off. None when only this host, or only key holders, can
    send."""
    if curve.enabled:
        return None
    host = bind_host.strip("[]")
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return None
    where = "every interface" if host in ("*", "0.0.0.0", "::") else host
    return (
        f"the trainer's ports listen on {where} without authentication: any host that can reach them "
        "can send groups (checked and counted, never executed) and read the weights. Make keys with "
        "`tandem keygen DIR trainer sampler` and set pipeline.curve.* (README: When to turn on CURVE), "
        "or bind loopback only with pipeline.bind_host=127.0.0.1"
    )


def start_server_auth(context: zmq.Context, curve: CurveConfig) -> CountingAuthenticator | None:
    """Start the ZAP handler of the trainer's context (None when CURVE is off)."""
    if not curve.enabled:
        return None
    folder = Path(curve.authorized_clients or "")
    if not folder.is_dir():
        raise FileNotFoundError(f"pipeline.curve.authorized_clients: folder {folder} not found")
    auth = CountingAuthenticator(context, str(folder))
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    return auth


def configure_server(sock: zmq.Socket, curve: CurveConfig, auth: CountingAuthenticator | None = None) -> None:
    """Make a trainer socket a CURVE server (before bind), its failed handshakes counted by
    `auth` when given; no-op when CURVE is off."""
    if not curve.enabled:
        return
    public, secret = _load(curve.server_secret_key, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    if auth is not None:
        auth.watch(sock)


# ----------------------------------------------------------------------------- sampler side


def configure_client(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Make a sampler socket a CURVE client of the trainer (before connect); no-op when off."""
    if not curve.enabled:
        return
    server_public, _ = _load(curve.server_public_key, secret=False)
    public, secret = _load(curve.client_secret_key, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


class HandshakeWatch:
    """Why the trainer at `address` refuses a sampler socket's handshakes, if it does.

    ZeroMQ drops a connection whose key the trainer refused, or that has CURVE on one side only,
    for good (a DEALER would then block on send forever); this tries again every RETRY_S seconds,
    so a sampler recovers once the trainer is restarted with matching keys. A wrong server key
    makes the trainer hang up at once, which ZeroMQ retries by itself. Call `check()` now and then
    from the socket's thread: it reads the socket's handshake events and reconnects."""

    def __init__(self, sock: zmq.Socket, address: str, curve: CurveConfig) -> None:
        self.address, self.curve = address, curve
        self.problem: str | None = None  # the diagnosis while handshakes fail
        self.num_failed = 0  # handshakes failed since the last one that succeeded
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED)
        self._retry_at: float | None = None
        self._vague = False  # the problem was guessed from hang-ups only

    def check(self) -> str | None:
        """The diagnosis while the trainer refuses this socket (None once a handshake succeeds)."""
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.problem, self.num_failed, self._retry_at = None, 0, None
                continue
            self.num_failed += 1
            diagnosis = handshake_diagnosis(event["event"], int(event["value"]), self.address, self.curve)
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._retry_at = time.monotonic() + RETRY_S
                self.problem, self._vague = diagnosis, False
            # a hang-up is vague: a trainer that stopped mid-handshake does it once, and a trainer
            # that refuses the mechanism often hangs up before its error reaches us
            elif self.num_failed >= 2 and (self.problem is None or self._vague):
                self.problem, self._vague = diagnosis, True
        if self._retry_at is not None and time.monotonic() >= self._retry_at:
            self._retry_at = None
            with suppress(zmq.ZMQError):  # ZeroMQ may have forgotten the endpoint already
                self._socket.disconnect(self.address)
            self._socket.connect(self.address)
        return self.problem

    def wait(self, timeout_ms: int) -> None:
        """Sleep until the next handshake event, or for `timeout_ms`."""
        self._monitor.poll(timeout_ms)

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)


def handshake_diagnosis(event: int, value: int, address: str, curve: CurveConfig) -> str:
    """What a failed handshake of a sampler with the trainer at `address` means, and the fix."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the trainer at {address} refused this sampler's CURVE key: the public key of "
            f"pipeline.curve.client_secret_key ({curve.client_secret_key}) is not in the trainer's "
            "pipeline.curve.authorized_clients folder; copy this sampler's public .key there and "
            "restart the trainer, or use a key whose public half is there"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH and curve.enabled:
        return (
            f"the trainer at {address} does not use CURVE, this sampler does: give the trainer "
            "pipeline.curve.server_secret_key and pipeline.curve.authorized_clients, or drop "
            "pipeline.curve.server_public_key and pipeline.curve.client_secret_key here"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH:
        return (
            f"the trainer at {address} requires CURVE and this sampler has none: set "
            "pipeline.curve.server_public_key (the trainer's public .key) and "
            "pipeline.curve.client_secret_key (this sampler's .key_secret, whose public .key is in "
            "the trainer's pipeline.curve.authorized_clients)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and curve.enabled:
        return (
            f"the trainer at {address} hangs up during the CURVE handshake: "
            f"pipeline.curve.server_public_key ({curve.server_public_key}) is most likely not the "
            "public key of the trainer's pipeline.curve.server_secret_key (or the trainer does not "
            "use CURVE, or this port is not the trainer's)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            f"the trainer at {address} hangs up during the handshake: it most likely requires CURVE "
            "(then set pipeline.curve.server_public_key and pipeline.curve.client_secret_key here), "
            "or this port is not the trainer's (pipeline.data_port, pipeline.sync_port)"
        )
    return (
        f"the ZeroMQ handshake with {address} fails (protocol error {value:#x}): is that port the "
        "trainer's (pipeline.data_port, pipeline.sync_port)?"
    )
