"""Weight sync over real ZeroMQ sockets and real files: versions, chunks, checksums, status, pruning."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

zmq = pytest.importorskip("zmq")

from tandem.transport.channel import free_tcp_port  # noqa: E402
from tandem.transport.weights import (  # noqa: E402
    FsWeightReader,
    FsWeightWriter,
    SnapshotBuffers,
    WeightClient,
    WeightServer,
    WeightSyncError,
    list_versions,
    load_weights,
    shared_prefix,
    take_snapshot,
    tensor_view,
)
from tandem.transport.wire import decode_control, encode_control, encode_weights_chunk  # noqa: E402


def model_pair(tiny_model_dir, seed=1):
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sampler = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    return trainer, sampler


def same_params(a, b) -> bool:
    return all(torch.equal(x, y.to(x.dtype)) for x, y in zip(a.parameters(), b.parameters()))


def test_snapshot_layout_is_aligned_and_exact(tiny_model):
    snap = take_snapshot(tiny_model.named_parameters(), version=3, run_id="r", chunk_bytes=1000)
    m = snap.manifest
    assert m.version == 3 and m.total_bytes == snap.flat.numel()
    assert all(t.offset % 64 == 0 for t in m.tensors)
    assert sum(n for _, n, _ in m.chunks) == m.total_bytes and all(n <= 1000 for _, n, _ in m.chunks)
    for spec, (name, p) in zip(m.tensors, tiny_model.named_parameters()):
        assert spec.name == name and torch.equal(tensor_view(snap.flat, spec), p)
    # the same weights give the same bytes, hashes included (padding is zeroed)
    again = take_snapshot(tiny_model.named_parameters(), version=3, run_id="r", chunk_bytes=1000)
    assert again.manifest == m and torch.equal(again.flat, snap.flat)


def test_snapshot_in_bfloat16_halves_the_bytes(tiny_model):
    full = take_snapshot(tiny_model.named_parameters(), version=0, run_id="r")
    half = take_snapshot(tiny_model.named_parameters(), version=0, run_id="r", dtype="bfloat16")
    assert half.manifest.total_bytes < 0.6 * full.manifest.total_bytes
    spec = half.manifest.tensors[0]
    expected = dict(tiny_model.named_parameters())[spec.name].to(torch.bfloat16)
    assert torch.equal(tensor_view(half.flat, spec), expected)


def test_load_weights_refuses_another_model(tiny_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    snap = take_snapshot(other.named_parameters(), version=0, run_id="r")
    with pytest.raises(WeightSyncError, match="same model.policy|shape"):
        load_weights(tiny_model, snap.flat, snap.manifest)


@pytest.fixture
def server_and_client():
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    server = WeightServer(address, run_id="run-a")
    client = WeightClient(address)
    yield server, client
    client.close()
    server.close()


def test_zmq_sync_versions_and_status(tiny_model_dir, server_and_client):
    server, client = server_and_client
    trainer, sampler = model_pair(tiny_model_dir)
    status = client.status()
    assert status.version == -1 and status.run_id == "run-a" and not status.finished
    assert client.fetch(timeout_s=5) is None  # nothing published yet

    for version in range(3):
        with torch.no_grad():
            next(trainer.parameters()).add_(1.0)
        server.publish(
            take_snapshot(trainer.named_parameters(), version=version, run_id="run-a", chunk_bytes=4096)
        )
        manifest, flat = client.fetch(timeout_s=5)
        assert manifest.version == version and len(manifest.chunks) > 3
        load_weights(sampler, flat, manifest)
        assert same_params(trainer, sampler)
    assert client.status().version == 2
    server.set_status(starved=True)
    assert client.status().starved


def test_snapshot_buffers_are_reused_only_when_no_fetch_reads_them(tiny_model_dir, server_and_client):
    server, client = server_and_client
    trainer, sampler = model_pair(tiny_model_dir)
    first = take_snapshot(trainer.named_parameters(), version=0, run_id="run-a", chunk_bytes=4096)
    server.publish(first)
    assert server.busy(first.flat)  # the published buffer is never overwritten
    manifest, flat = client.fetch(timeout_s=5)
    second = take_snapshot(trainer.named_parameters(), version=1, run_id="run-a", chunk_bytes=4096)
    server.publish(second)
    deadline = time.monotonic() + 5
    while server.busy(first.flat) and time.monotonic() < deadline:  # the fetch has left the socket
        time.sleep(0.01)
    assert not server.busy(first.flat) and server.busy(second.flat)
    with torch.no_grad():
        next(trainer.parameters()).add_(1.0)
    reused = take_snapshot(
        trainer.named_parameters(), version=2, run_id="run-a", chunk_bytes=4096, out=first.flat
    )
    assert reused.flat.data_ptr() == first.flat.data_ptr()
    server.publish(reused)
    manifest, flat = client.fetch(timeout_s=5)
    assert manifest.version == 2
    load_weights(sampler, flat, manifest)
    assert same_params(trainer, sampler)
    # a buffer of the wrong size is not used
    other = take_snapshot(
        trainer.named_parameters(), version=3, run_id="run-a", out=torch.empty(8, dtype=torch.uint8)
    )
    assert other.flat.numel() == reused.flat.numel()


def test_a_local_trainer_also_listens_on_a_unix_socket(tiny_model):
    from tandem.transport.weights import sync_address

    port = free_tcp_port()
    server = WeightServer(f"tcp://127.0.0.1:{port}", run_id="run-l")
    try:
        assert server.local_address is not None and sync_address("127.0.0.1", port) == server.local_address
        assert sync_address("10.0.0.7", port) == f"tcp://10.0.0.7:{port}"
        server.publish(take_snapshot(tiny_model.named_parameters(), version=4, run_id="run-l"))
        client = WeightClient(server.local_address)
        assert client.fetch(timeout_s=5)[0].version == 4
        client.close()
    finally:
        server.close()


def test_zmq_long_poll_wakes_on_publish(tiny_model, server_and_client):
    server, client = server_and_client
    server.publish(take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a"))
    start = time.monotonic()
    assert client.status(newer_than=0, run_id="run-a", wait_s=0.3).version == 0  # nothing new: waits
    assert time.monotonic() - start >= 0.25
    timer = threading.Timer(
        0.2, lambda: server.publish(take_snapshot(tiny_model.named_parameters(), version=1, run_id="run-a"))
    )
    timer.start()
    start = time.monotonic()
    status = client.status(newer_than=0, run_id="run-a", wait_s=10)
    assert status.version == 1 and time.monotonic() - start < 5
    timer.join()
    # another trainer (a new run id) is news too, whatever its version
    assert client.status(newer_than=5, run_id="run-b", wait_s=10).version == 1


def test_zmq_server_drops_hostile_requests_and_keeps_serving(tiny_model, server_and_client):
    server, client = server_and_client
    server.publish(take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a"))
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(server.address)
    import pickle

    for frames in (
        [b"\x80junk"],
        [pickle.dumps(object)],
        encode_control("rm -rf", {"request": "x"}),
        [b"{}", b"extra"],
        encode_control("status", {"request": 5}),
    ):
        hostile.send_multipart(frames)
    hostile.send(b"x" * (128 * 1024))  # over the request size cap: ZeroMQ cuts that peer off
    deadline = time.monotonic() + 5
    while sum(server.dropped.values()) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(server.dropped.values()) >= 5
    assert client.fetch(timeout_s=5)[0].version == 0
    hostile.close()
    ctx.term()


def test_zmq_client_rejects_a_corrupt_chunk(tiny_model, server_and_client):
    server, client = server_and_client
    snap = take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a", chunk_bytes=4096)
    snap.flat[5000] ^= 0xFF  # corrupted after hashing
    server.publish(snap)
    with pytest.raises(WeightSyncError, match="checksum"):
        client.fetch(timeout_s=5)


def test_client_of_a_silent_trainer_times_out():
    client = WeightClient(f"tcp://127.0.0.1:{free_tcp_port()}")
    start = time.monotonic()
    assert client.status(timeout_s=0.2) is None and client.fetch(timeout_s=0.2) is None
    assert time.monotonic() - start < 3
    client.close()


def slow_trainer(snap, address: str, *, pause_s: float, stop_after: int) -> threading.Thread:
    """A hand-driven trainer that answers one fetch with `stop_after` chunks, `pause_s` apart."""

    def serve() -> None:
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        identity, body = router.recv_multipart()
        request = decode_control([body], max_bytes=4096)[1]["request"]
        for index in range(stop_after):
            time.sleep(pause_s)
            router.send_multipart(
                [identity, *encode_weights_chunk(snap.manifest, index, snap.chunk(index), request=request)]
            )
        time.sleep(0.5)
        router.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_fetch_waits_for_a_slow_transfer_but_not_for_a_silent_one(tiny_model):
    snap = take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a", chunk_bytes=4096)
    n = len(snap.manifest.chunks)
    assert n >= 8
    # chunks keep coming: the whole transfer outlasts timeout_s and still completes
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    thread = slow_trainer(snap, address, pause_s=2.0 / (n // 2), stop_after=n)
    client = WeightClient(address)
    manifest, flat = client.fetch(timeout_s=2.0)
    assert manifest.version == 0 and torch.equal(flat, snap.flat)
    client.close()
    thread.join()
    # the trainer stops half-way (it died): the fetch gives up instead of waiting for the rest
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    thread = slow_trainer(snap, address, pause_s=0.0, stop_after=n // 2)
    client = WeightClient(address)
    assert client.fetch(timeout_s=1.0) is None
    client.close()
    thread.join()


def test_a_malformed_status_is_dropped_and_counted_not_raised(tmp_path):
    """The trainer's status has a strict schema (wire.status_from_json): a reply or a status.json
    that misses a field is ignored and counted by the sampler's side, which asks again."""
    address = f"tcp://127.0.0.1:{free_tcp_port()}"

    def serve() -> None:  # a trainer that answers a status request without `take_versions`
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        identity, body = router.recv_multipart()
        request = decode_control([body], max_bytes=4096)[1]["request"]
        payload = {"request": request, "version": 0, "run_id": "r", "starved": False, "finished": False}
        router.send_multipart([identity, *encode_control("status", {**payload, "batches": 0})])
        time.sleep(0.5)
        router.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = WeightClient(address)
    assert client.status(timeout_s=1.0) is None and client.dropped["invalid"] == 1
    client.close()
    thread.join()

    writer = FsWeightWriter(tmp_path / "weights", run_id="r")
    reader = FsWeightReader(tmp_path / "weights")
    assert reader.status().version == -1
    (tmp_path / "weights" / "status.json").write_text('{"version": 0, "run_id": "r"}')
    assert reader.status() is None and reader.dropped["invalid"] == 1
    writer.close()


def test_fs_sync_is_atomic_checksummed_and_pruned(tiny_model_dir, tmp_path):
    trainer, sampler = model_pair(tiny_model_dir)
    writer = FsWeightWriter(tmp_path / "weights", run_id="run-a", keep=2)
    reader = FsWeightReader(tmp_path / "weights")
    assert reader.status().version == -1 and reader.fetch() is None
    # a half-written version (a crash before the rename) is never picked up
    (tmp_path / "weights" / ".tmp-v00000009-x").mkdir()
    (tmp_path / "weights" / ".tmp-v00000009-x" / "weights.bin").write_bytes(b"half")
    for version in range(4):
        with torch.no_grad():
            next(trainer.parameters()).mul_(1.5)
        writer.publish(
            take_snapshot(trainer.named_parameters(), version=version, run_id="run-a", chunk_bytes=4096)
        )
        manifest, flat = reader.fetch()
        assert manifest.version == version
        load_weights(sampler, flat, manifest)
        assert same_params(trainer, sampler)
    assert [v for v, _ in list_versions(tmp_path / "weights")] == [2, 3]
    assert reader.status(newer_than=2, run_id="run-a").version == 3
    writer.set_status(finished=True)
    assert reader.status().finished
    manifest_path = tmp_path / "weights" / "v00000003" / "manifest.json"
    assert json.loads(manifest_path.read_text())["version"] == 3
    bin_path = tmp_path / "weights" / "v00000003" / "weights.bin"
    data = bytearray(bin_path.read_bytes())
    data[100] ^= 1
    bin_path.write_bytes(bytes(data))
    with pytest.raises(WeightSyncError, match="checksum"):
        reader.fetch()
    # a finished run leaves no weights behind (the model is in final/), only the status
    writer.close()
    assert list_versions(tmp_path / "weights") == [] and reader.status().finished
    assert reader.fetch() is None


def test_an_interrupted_fs_writer_keeps_its_newest_versions(tiny_model, tmp_path):
    writer = FsWeightWriter(tmp_path / "weights", run_id="run-a", keep=2)
    for version in range(3):
        writer.publish(take_snapshot(tiny_model.named_parameters(), version=version, run_id="run-a"))
    writer.close()  # not finished: samplers that outlive it still find the newest weights
    assert [v for v, _ in list_versions(tmp_path / "weights")] == [1, 2]


def test_a_finished_server_knows_which_samplers_have_not_heard_it(tiny_model, server_and_client):
    server, client = server_and_client
    server.publish(take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a"))
    assert client.status().version == 0
    assert server.untold() == 1  # heard from, not yet told
    server.set_status(finished=True)
    assert server.untold() == 1
    assert client.status().finished
    assert server.untold() == 0
    assert server.untold(window_s=0) == 0  # nobody seen that recently


def test_a_finished_server_forgets_samplers_that_left(tiny_model):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    server = WeightServer(address, run_id="run-a")
    try:
        server.publish(take_snapshot(tiny_model.named_parameters(), version=0, run_id="run-a"))
        gone = WeightClient(address)
        assert gone.status().version == 0
        gone.close()  # leaves without hearing that the run finished
        assert server.untold() == 1
        server.set_status(finished=True)
        deadline = time.monotonic() + 10
        while server.untold() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.untold() == 0
    finally:
        server.close()


# --- lent shared snapshots (a sampler on the trainer's host) ---------------------------------------


def shared_server(run_id: str):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    return (
        WeightServer(address, run_id=run_id),
        WeightClient(address),
        SnapshotBuffers(shared_prefix=shared_prefix(run_id)),
    )


@pytest.mark.skipif(shared_prefix("ab") is None, reason="no /dev/shm")
def test_a_local_sampler_loads_a_lent_snapshot_without_bytes_sent(tiny_model_dir):
    trainer, sampler = model_pair(tiny_model_dir)
    server, client, buffers = shared_server("a1b2c3")
    try:
        snap = buffers.snapshot(trainer.named_parameters(), publisher=server, version=0, run_id="a1b2c3")
        assert snap.path is not None and Path(snap.path).exists()
        # already unlinked: a killed trainer can leave nothing behind in /dev/shm
        assert not list(Path("/dev/shm").glob("tandem-a1b2c3-*"))
        server.publish(snap)
        manifest, flat = client.fetch(shared=True)
        assert manifest == snap.manifest and torch.equal(flat, snap.flat)
        assert flat.data_ptr() != snap.flat.data_ptr()  # a mapping of the same file, not a copy sent
        load_weights(sampler, flat, manifest)
        assert client.lease_held() and same_params(trainer, sampler)
        assert server.served["shared"] == 1 and server.served["fetch"] == 0
        # the lent buffer is not overwritten while the lease runs: the next version takes another
        nxt = buffers.snapshot(trainer.named_parameters(), publisher=server, version=1, run_id="a1b2c3")
        assert nxt.flat.data_ptr() != snap.flat.data_ptr() and nxt.path != snap.path
        # a remote-style fetch of the same version still gets chunks
        server.publish(nxt)
        manifest, flat = client.fetch()
        assert manifest.version == 1 and server.served["fetch"] == 1
        paths = [snap.path, nxt.path]
    finally:
        client.close()
        server.close()
        buffers.close()
    for path in paths:  # the trainer closed its files (an fd number may since hold something else)
        assert not Path(path).exists() or "tandem-a1b2c3" not in os.readlink(path)


def _outward_ip() -> str | None:
    """An address of this machine that is not loopback (a TCP peer using it looks like another host)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, the route picks our address
            ip = probe.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


@pytest.mark.skipif(
    shared_prefix("ab") is None or _outward_ip() is None, reason="no /dev/shm or no network address"
)
def test_the_same_host_snapshot_is_never_lent_to_a_peer_on_another_address(tiny_model_dir):
    """A peer that reaches the trainer over a non-loopback address asks for the memory-file
    snapshot: it gets the chunks instead (nothing pinned for LEASE_S), and the refusal is counted."""
    trainer, sampler = model_pair(tiny_model_dir)
    address = f"tcp://{_outward_ip()}:{free_tcp_port()}"
    server, client = WeightServer(address, run_id="f0f1f2"), WeightClient(address)
    buffers = SnapshotBuffers(shared_prefix=shared_prefix("f0f1f2"))
    try:
        snap = buffers.snapshot(trainer.named_parameters(), publisher=server, version=0, run_id="f0f1f2")
        assert snap.path is not None
        server.publish(snap)
        manifest, flat = client.fetch(shared=True)
        load_weights(sampler, flat, manifest)
        assert same_params(trainer, sampler) and client.lease_until is None
        assert server.served["shared"] == 0 and server.served["fetch"] == 1
        assert server.served["lend_refused"] == 1 and not server.busy(
            buffers.snapshot(trainer.named_parameters(), publisher=server, version=1, run_id="f0f1f2").flat
        )
    finally:
        client.close()
        server.close()
        buffers.close()


def test_malformed_weight_requests_are_dropped_counted_and_logged_at_a_bounded_rate(caplog):
    """12k bad requests (a lone surrogate request id among them, which once cost a traceback each)
    leave a handful of warning lines, the count in stats(), and a server that still answers."""
    import logging

    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    server, client = WeightServer(address, run_id="b0b1b2"), WeightClient(address)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.transport.weights.zmq_server"):
            for _ in range(4000):
                dealer.send(b"not json")
                dealer.send(b'{"schema": 1, "kind": "status", "request": "\\ud800"}')
                dealer.send(encode_control("status", {"request": "r" * 1000})[0])
            deadline = time.monotonic() + 30
            while server.stats()["weight_requests_dropped"] < 12_000 and time.monotonic() < deadline:
                time.sleep(0.05)
            status = client.status(timeout_s=10)
        assert status.run_id == "b0b1b2"
        assert server.stats()["weight_requests_dropped"] == 12_000
        assert len(caplog.records) <= 6 and not any(r.exc_info for r in caplog.records)
    finally:
        dealer.close()
        context.term()
        client.close()
        server.close()


@pytest.mark.skipif(shared_prefix("ab") is None, reason="no /dev/shm")
def test_a_lease_that_ran_out_is_noticed_and_frees_the_buffer(tiny_model_dir, monkeypatch):
    from tandem.transport.weights import zmq_server

    monkeypatch.setattr(zmq_server, "LEASE_S", 0.2)
    trainer, sampler = model_pair(tiny_model_dir)
    server, client, buffers = shared_server("d4e5f6")
    try:
        snap = buffers.snapshot(trainer.named_parameters(), publisher=server, version=0, run_id="d4e5f6")
        server.publish(snap)
        client.fetch(shared=True)
        time.sleep(0.3)
        assert not client.lease_held()  # the sampler would fetch chunks again
        server.publish(take_snapshot(trainer.named_parameters(), version=1, run_id="d4e5f6"))
        assert not server.busy(snap.flat)  # neither published nor lent any more: reusable
    finally:
        client.close()
        server.close()
        buffers.close()


def test_a_loan_naming_another_file_is_refused(tiny_model):
    """A reply that lends anything but a tandem snapshot file in /dev/shm is an error, never mapped."""
    import zmq

    from tandem.transport.wire import manifest_to_json

    snap = take_snapshot(tiny_model.named_parameters(), version=0, run_id="r")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = WeightClient(f"tcp://127.0.0.1:{port}")
    try:
        for path in ("/etc/passwd", "/proc/1/fd/../../../etc/passwd", "/dev/shm/tandem-ab-0.weights"):
            result = {}
            thread = threading.Thread(target=lambda out=result: out.update(error=_fetch_error(client)))
            thread.start()
            identity, request = router.recv_multipart()
            request_id = json.loads(request)["payload"]["request"]
            payload = {
                "request": request_id,
                "path": path,
                "lease_until": time.monotonic() + 5,
                "manifest": manifest_to_json(snap.manifest),
            }
            router.send_multipart([identity, *encode_control("shared", payload)])
            thread.join(timeout=10)
            assert "malformed shared snapshot" in result["error"], path
    finally:
        client.close()
        router.close(linger=0)
        ctx.term()


def _fetch_error(client) -> str:
    try:
        client.fetch(shared=True, timeout_s=5)
    except WeightSyncError as err:
        return str(err)
    return "no error"


@pytest.mark.skipif(shared_prefix("ab") is None, reason="no /dev/shm")
def test_a_released_loan_frees_the_buffer_at_once(tiny_model_dir):
    trainer, _ = model_pair(tiny_model_dir)
    server, client, buffers = shared_server("a7a7a7")
    try:
        first = buffers.snapshot(
            trainer.named_parameters(), publisher=server, version=0, run_id="a7a7a7", hashed=False
        )
        server.publish(first)
        assert client.fetch(shared=True) is not None
        server.publish(take_snapshot(trainer.named_parameters(), version=1, run_id="a7a7a7"))
        assert server.busy(first.flat)  # lent: not reused while the lease runs...
        client.release()
        deadline = time.monotonic() + 5
        while server.busy(first.flat) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.busy(first.flat)  # ...until the borrower says it is done
    finally:
        client.close()
        server.close()
        buffers.close()


def test_hashes_can_wait_until_a_reader_needs_them(tiny_model):
    lazy = take_snapshot(tiny_model.named_parameters(), version=2, run_id="r", chunk_bytes=1000, hashed=False)
    eager = take_snapshot(tiny_model.named_parameters(), version=2, run_id="r", chunk_bytes=1000)
    assert all(digest == "" for _, _, digest in lazy.manifest.chunks)
    assert lazy.hashed().manifest == eager.manifest and lazy.hashed() is lazy.hashed()
