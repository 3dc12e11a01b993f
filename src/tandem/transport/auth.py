"""Optional CURVE authentication and encryption of both channels (ZeroMQ's public-key security).

Turn it on whenever a port is reachable by anyone else: without it, whoever reaches port 5555 can
feed the trainer experience, and whoever reaches 5556 can read the weights. Keys come from
`tandem keygen DIR`; the trainer accepts only samplers whose public key lies in its
`authorized_clients` folder and counts the ones it refuses.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tandem.config import CurveConfig

log = logging.getLogger(__name__)


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


class CountingAuthenticator(ThreadAuthenticator):
    """The ZAP handler of a context; `refused` counts handshakes it turned down."""

    def __init__(self, context: zmq.Context) -> None:
        super().__init__(context)
        self.refused = 0
        self._lock = threading.Lock()

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous") -> None:
        if status_code != b"200":
            with self._lock:
                self.refused += 1
            log.warning(
                "refused a peer without an authorised CURVE key (%d so far): %s",
                self.refused,
                status_text.decode(errors="replace"),
            )
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


def start_server_auth(context: zmq.Context, curve: CurveConfig) -> CountingAuthenticator | None:
    """Start the ZAP handler of the trainer's context (None when CURVE is off)."""
    if not curve.enabled:
        return None
    folder = Path(curve.authorized_clients or "")
    if not folder.is_dir():
        raise FileNotFoundError(f"pipeline.curve.authorized_clients: folder {folder} not found")
    auth = CountingAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    return auth


def configure_server(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Make a trainer socket a CURVE server (before bind); no-op when CURVE is off."""
    if not curve.enabled:
        return
    public, secret = _load(curve.server_secret_key, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def configure_client(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Make a sampler socket a CURVE client of the trainer (before connect); no-op when off."""
    if not curve.enabled:
        return
    server_public, _ = _load(curve.server_public_key, secret=False)
    public, secret = _load(curve.client_secret_key, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
