"""A /dev/shm without room for a weight snapshot (Docker's default is 64 MB) is one log line and a
fallback to the socket, never a SIGBUS: the trainer reserves a snapshot file's pages before it writes.

Each case runs a trainer-side publisher and a same-host sampler in a child process (a SIGBUS there
fails the test instead of killing pytest): once on a real 1 MB tmpfs (mounting needs root; skipped
without it), once with the file-size limit of the process below the snapshot's size (any user)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, logging, resource, signal, sys, io
    import torch
    from tandem.transport.channel import free_tcp_port
    from tandem.transport.weights import SnapshotBuffers, WeightClient, WeightServer

    prefix, limit = sys.argv[1], int(sys.argv[2])
    if limit:  # writes past the limit fail with EFBIG instead of raising SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    stream = io.StringIO()
    logging.basicConfig(stream=stream, level=logging.WARNING)
    weights = [("w", torch.arange(2**20, dtype=torch.float32)), ("b", torch.ones(1000))]  # 4 MB
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    server, client = WeightServer(address, run_id="r1"), WeightClient(address)
    buffers = SnapshotBuffers(shared_prefix=prefix)
    try:
        snaps = [buffers.snapshot(weights, publisher=server, version=v, run_id="r1") for v in (0, 1)]
        server.publish(snaps[-1])
        manifest, flat = client.fetch(shared=True)
        got = flat[: 4 * 2**20].view(torch.float32)
        print(json.dumps({
            "paths": [s.path for s in snaps],
            "same": bool(torch.equal(got, weights[0][1])),
            "served": dict(server.served),
            "log": stream.getvalue(),
        }))
    finally:
        client.close(); server.close(); buffers.close()
    """
)


def _run(prefix: str, limit: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, prefix, str(limit)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_fell_back(result: dict) -> None:
    assert result["paths"] == [None, None]  # nothing lent as a shared file
    assert result["same"] and result["served"]["fetch"] == 1 and result["served"].get("shared", 0) == 0
    lines = [line for line in result["log"].splitlines() if "shared-memory buffer" in line]
    assert len(lines) == 1, result["log"]  # one line for the run, not one per snapshot
    assert "--ipc=host" in lines[0] and "4.2 MB snapshot" in lines[0]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "shm"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()[:80]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_tmpfs_falls_back_to_the_socket_without_a_signal(tiny_tmpfs):
    """A 1 MB tmpfs granted a 4 MB ftruncate and killed the writer with SIGBUS."""
    _assert_fell_back(_run(f"{tiny_tmpfs}/tandem-r1"))
    assert not list(tiny_tmpfs.iterdir())


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_no_room_by_the_file_size_limit_falls_back_too():
    prefix = f"/dev/shm/tandem-test-{uuid.uuid4().hex[:8]}"
    _assert_fell_back(_run(prefix, limit=2**20))
    assert not list(Path("/dev/shm").glob(f"{Path(prefix).name}*"))
