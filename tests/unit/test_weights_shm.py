"""Snapshot buffers in shared memory (transport/weights/snapshot.py): a file's pages are reserved
before any write, so a /dev/shm without room is one log line and the socket, never a SIGBUS; where the files
go; page-locking them for a GPU's copies (checked with a stand-in CUDA runtime here, for real under
the `gpu` marker)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from integration.test_shm_exhaustion import CHILD, _assert_fell_back
from tandem.transport.weights import SnapshotBuffers, reserve, shared_prefix, snapshot, take_snapshot

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 3 * 2**20 + 100  # not a whole number of pages or of write blocks


class Busy:
    """A publisher whose every buffer is still being read: each snapshot takes a new buffer."""

    def busy(self, flat: torch.Tensor) -> bool:
        return True


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


@pytest.fixture
def fd(tmp_path):
    fd = os.open(tmp_path / "buffer", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


# ----------------------------------------------------------------------------- reserving pages


def test_reserve_takes_every_page_up_front(fd):
    os.ftruncate(fd, NBYTES)
    assert allocated(fd) < NBYTES  # ftruncate alone: a sparse file, room promised and not taken
    reserve(fd, NBYTES)
    assert allocated(fd) >= NBYTES


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
def test_without_fallocate_support_the_pages_are_written(fd, monkeypatch, code):
    """A filesystem that cannot fallocate (musl passes EOPNOTSUPP on, glibc emulates it): written."""

    def unsupported(fd, offset, nbytes):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    os.ftruncate(fd, NBYTES)
    reserve(fd, NBYTES)
    assert allocated(fd) >= NBYTES and os.fstat(fd).st_size == NBYTES
    assert os.pread(fd, NBYTES + 1, 0) == bytes(NBYTES)


def test_a_python_without_posix_fallocate_writes_the_pages(fd, monkeypatch):
    monkeypatch.delattr(os, "posix_fallocate")  # macOS has none
    reserve(fd, NBYTES)
    assert allocated(fd) >= NBYTES and os.fstat(fd).st_size == NBYTES


def test_no_room_is_an_error_not_a_fallback_to_sparse(fd, monkeypatch):
    def full(fd, offset, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as info:
        reserve(fd, NBYTES)
    assert info.value.errno == errno.ENOSPC and allocated(fd) == 0


def test_an_empty_snapshot_still_gets_a_shared_buffer(tmp_path, caplog):
    """posix_fallocate refuses a length of 0 (EINVAL): nothing to reserve, nothing to warn about."""
    buffers = SnapshotBuffers(shared_prefix=f"{tmp_path}/tandem-r1")
    with caplog.at_level(logging.WARNING, logger="tandem.transport.weights.snapshot"):
        snap = buffers.snapshot([], publisher=Busy(), version=0, run_id="r1")
    buffers.close()
    assert snap.path is not None and snap.manifest.total_bytes == 0 and not caplog.records


def test_shared_files_go_where_they_are_told(tmp_path):
    assert shared_prefix("r1", str(tmp_path)) == f"{tmp_path}/tandem-r1"
    assert shared_prefix("r1", str(tmp_path / "missing")) is None
    buffers = SnapshotBuffers(shared_prefix=shared_prefix("r1", str(tmp_path)))
    snap = buffers.snapshot([("w", torch.ones(10))], publisher=Busy(), version=0, run_id="r1")
    assert snap.path is not None and torch.equal(snap.flat[:40].view(torch.float32), torch.ones(10))
    assert not list(tmp_path.iterdir())  # unlinked at once: only the open fd keeps it
    buffers.close()


def test_the_log_line_says_what_is_needed_and_the_fix(tmp_path):
    err = OSError(errno.ENOSPC, "No space left on device")
    line = snapshot.no_shared_buffer_message(tmp_path, 6_200_000_000, 3, err)
    assert "6.20 GB snapshot" in line and "3 snapshots (18.60 GB)" in line
    assert " free" in line and "--ipc=host" in line and "--shm-size=19g" in line  # 17.3 GiB, rounded up, +1


# ----------------------------------------------------------------------------- a real full tmpfs


@pytest.fixture(scope="module")
def user_namespaces():
    """A 1 MB tmpfs needs a mount: in a user namespace of our own, any user may (where the kernel
    allows unprivileged user namespaces)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespaces here ({probe.stderr.strip()[:80]})")


NO_FALLOCATE = """
import errno, os
def unsupported(fd, offset, nbytes):
    raise OSError(errno.EOPNOTSUPP, "Operation not supported")
os.posix_fallocate = unsupported
"""


@pytest.mark.parametrize("fallocate", ["posix_fallocate", "writes the pages"])
def test_a_full_tmpfs_falls_back_to_the_socket_without_a_signal(user_namespaces, tmp_path, fallocate):
    """A trainer and a same-host sampler over real ZeroMQ, the trainer's /dev/shm a 1 MB tmpfs (its
    4 MB snapshot was granted by ftruncate and killed the writer with SIGBUS): no signal, one log
    line, the sampler gets the same weights, and nothing is left in the tmpfs."""
    mount = tmp_path / "shm"
    mount.mkdir()
    code = (NO_FALLOCATE if fallocate == "writes the pages" else "") + CHILD
    script = (
        'mount -t tmpfs -o size=1m tmpfs "$1" || exit 99; '
        '"$2" -c "$3" "$1/tandem-r1" 0; rc=$?; echo "left:$(ls -A "$1")"; exit $rc'
    )
    proc = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", script, "sh", str(mount), sys.executable, code],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (135, -7: SIGBUS): {proc.stderr[-3000:]}"
    *_, result, left = proc.stdout.strip().splitlines()
    result = json.loads(result)
    _assert_fell_back(result)
    assert "has 1.0 MB free" in result["log"] and "--shm-size=2g" in result["log"]
    assert result["log"].count("WARNING") == 1, result["log"]
    assert left == "left:"


# ----------------------------------------------------------------------------- copies and page-locking


def test_a_cpu_snapshot_is_plain_copies_and_never_waits_for_cuda(monkeypatch):
    def no_cuda():
        raise AssertionError("a CPU snapshot waited for CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    named = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.full((3,), 2.0, dtype=torch.bfloat16))]
    snap = take_snapshot(named, version=0, run_id="r")
    # a at 0 (20 bytes), b at the next multiple of 64 (6 bytes), the rest zero
    expected = torch.zeros(128, dtype=torch.uint8)
    expected[:20] = named[0][1].view(torch.uint8)
    expected[64:70] = named[1][1].view(torch.uint8)
    assert torch.equal(snap.flat, expected)


@pytest.fixture
def cuda_host(monkeypatch):
    """A stand-in CUDA runtime: the snapshot's tensors count as on device 0, and every page-locking
    call is recorded (answering `result`) instead of made."""
    calls: list[tuple] = []
    stand_in = {"result": 0, "calls": calls}

    def call(name, device, *args):
        calls.append((name, device, *args))
        return stand_in["result"] if name == "cudaHostRegister" else 0

    monkeypatch.setattr(snapshot, "_cuda_device", lambda named: 0)
    monkeypatch.setattr(snapshot, "_cuda_host_call", call)
    return stand_in


def test_shared_buffers_of_a_gpu_trainer_are_page_locked_until_they_leave(tmp_path, cuda_host):
    buffers = SnapshotBuffers(keep=1, shared_prefix=f"{tmp_path}/tandem-r1")
    named = [("w", torch.ones(1000))]
    first = buffers.snapshot(named, publisher=Busy(), version=0, run_id="r1")
    second = buffers.snapshot(named, publisher=Busy(), version=1, run_id="r1")  # the first leaves the pool
    buffers.close()
    ptr1, ptr2, size = first.flat.data_ptr(), second.flat.data_ptr(), first.manifest.total_bytes
    assert cuda_host["calls"] == [
        ("cudaHostRegister", 0, ptr1, size, 1),
        ("cudaHostRegister", 0, ptr2, size, 1),
        ("cudaHostUnregister", 0, ptr1),
        ("cudaHostUnregister", 0, ptr2),
    ]


def test_a_buffer_that_cannot_be_page_locked_is_used_as_it_is(tmp_path, cuda_host, caplog):
    cuda_host["result"] = 801  # cudaErrorNotSupported
    buffers = SnapshotBuffers(keep=1, shared_prefix=f"{tmp_path}/tandem-r1")
    with caplog.at_level(logging.INFO, logger="tandem.transport.weights.snapshot"):
        snaps = [
            buffers.snapshot([("w", torch.ones(10))], publisher=Busy(), version=v, run_id="r1")
            for v in (0, 1)
        ]
    buffers.close()
    assert all(s.path is not None for s in snaps)  # still shared with same-host samplers
    assert [c[0] for c in cuda_host["calls"]] == ["cudaHostRegister"]  # tried once, nothing to undo
    assert [r.levelname for r in caplog.records] == ["INFO"] and "cudaError 801" in caplog.text


def test_heap_buffers_of_a_gpu_trainer_are_registered_too(cuda_host):
    """Registered like the shared files, not allocated with pin_memory=True (whose caching allocator
    rounds up to a power of two: 8 GB page-locked for a 6.2 GB snapshot)."""
    buffers = SnapshotBuffers(keep=1)
    snaps = [
        buffers.snapshot([("w", torch.ones(10))], publisher=Busy(), version=version, run_id="r1")
        for version in (0, 1)
    ]
    buffers.close()
    first, second = (snap.flat.data_ptr() for snap in snaps)
    size = snaps[0].manifest.total_bytes
    assert cuda_host["calls"] == [
        ("cudaHostRegister", 0, first, size, 1),
        ("cudaHostRegister", 0, second, size, 1),
        ("cudaHostUnregister", 0, first),
        ("cudaHostUnregister", 0, second),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch without CUDA")
def test_without_a_cuda_runtime_page_locking_fails_quietly():
    assert snapshot._cuda_host_call("cudaHostRegister", 0, 0, 0, 1) == -1


@pytest.mark.gpu
@pytest.mark.skipif(shared_prefix("ab") is None, reason="no /dev/shm")
def test_a_gpu_snapshot_into_a_page_locked_shared_buffer():
    model = torch.nn.Linear(300, 200).cuda()
    named = list(model.named_parameters())
    buffers = SnapshotBuffers(shared_prefix=shared_prefix(f"test-{uuid.uuid4().hex[:8]}"))
    snap = buffers.snapshot(named, publisher=Busy(), version=0, run_id="r")
    assert snap.path is not None and buffers._buffers[0][2] == torch.cuda.current_device()
    assert snap.flat.is_pinned()
    plain = take_snapshot([(n, p.cpu()) for n, p in named], version=0, run_id="r")
    assert torch.equal(snap.flat, plain.flat)
    buffers.close()
    assert not snap.flat.is_pinned()  # unregistered while its mapping lives on


@pytest.mark.gpu
def test_a_failed_cuda_host_call_leaves_no_error_behind():
    """A failed runtime call sets its thread's last error; the next kernel launch in that thread
    would raise it. The call runs in a thread of its own."""
    stray = torch.empty(4096, dtype=torch.uint8)
    assert snapshot._cuda_host_call("cudaHostUnregister", 0, stray.data_ptr()) != 0  # never registered
    assert torch.ones(4, device="cuda").add_(1).sum().item() == 8
