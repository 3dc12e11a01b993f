"""Weight sync of a 135M-parameter fp32 policy, trainer -> sampler process, against a memory copy.

  .venv/bin/python benchmarks/weight_sync.py [--quick] [--repeats 5] [--model random|embedded]
                                             [--sync-dtype bfloat16] [--chunk-mib 8]
                                             [--skip-gloo]

The policy has SmolLM2-135M's shapes (Llama: 30 layers, hidden 576, intermediate 1536, 9 heads /
3 kv heads, vocab 49152, tied embeddings: 134.5M parameters, 538 MB in fp32), random by default;
`--model embedded` loads the real embedded model in both processes instead. Measured side by side,
median of `--repeats` (after one warm-up):
(a) the anchor: a plain `copy_` of the same bytes between two pre-faulted flat buffers (and into a
    freshly allocated one, which also pays the page faults a new buffer costs);
(b) `zmq`: trainer `take_snapshot` + `WeightServer.publish`; a spawned sampler process long-polls
    `WeightClient.status`, then `fetch` + `load_weights` into its model, over the trainer's ipc twin
    of its TCP port, snapshot buffers reused as the trainer does: chunks sent over a socket, what a
    sampler on another host gets (at its network's speed);
    `zmq_shared`: the same, with the snapshot buffers in /dev/shm files as tandem's trainer keeps
    them, and the sampler asking to be lent the snapshot (what a sampler on the trainer's host does):
    it maps the file and loads from it, no bytes sent;
(c) `fs`: `take_snapshot` + `FsWeightWriter.publish` (write, fsync, rename, prune); the sampler polls
    `FsWeightReader.status`, then `fetch` + `load_weights`; in /dev/shm (if present) and in /tmp;
(d) torch.distributed gloo broadcast of the same bytes between 2 processes (bytes only: no
    snapshot, no load), for comparison.
Latency is what the sampler sees: from the start of the trainer's snapshot to the weights loaded in
the sampler's model (both processes read CLOCK_MONOTONIC). Target: <= 0.15 s per sync on one host.
The split (snapshot, publish, notify, fetch, load) gives each part's own median, so the parts need
not add up exactly. `--chunk-mib` sets the chunk size.
Writes benchmarks/results/runs/weight_sync-<time>.json (`--update-results`: the tracked
benchmarks/results/weight_sync.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py
from tandem.transport.channel import free_tcp_port
from tandem.transport.weights import (
    CHUNK_BYTES,
    FsWeightReader,
    FsWeightWriter,
    SnapshotBuffers,
    WeightClient,
    WeightServer,
    load_weights,
    new_run_id,
    shared_prefix,
    sync_address,
)
from tandem.transport.wire import WEIGHT_DTYPES

HERE = Path(__file__).resolve().parent
TARGET_SECONDS = 0.15
# SmolLM2-135M (LlamaForCausalLM)
NUM_LAYERS, HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, VOCAB = 30, 576, 1536, 9, 3, 49152


def llama_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes as `named_parameters()` lists them (the tied lm_head appears once)."""
    kv = HIDDEN // NUM_HEADS * NUM_KV_HEADS
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*shapes, ("model.norm.weight", (HIDDEN,))]


def build_model(kind: str) -> torch.nn.Module:
    if kind == "embedded":
        from tandem.models.loading import load_causal_lm

        return load_causal_lm("embedded")
    gen = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    for name, shape in llama_shapes():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        weight = torch.empty(shape).uniform_(-0.02, 0.02, generator=gen)  # touched: no lazy page faults
        module.register_parameter(leaf, torch.nn.Parameter(weight))
    return root


def first_param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


def sync_bytes(model: torch.nn.Module, dtype: str | None) -> int:
    """Bytes one version carries: the parameters in the sync dtype (None: their own)."""
    return sum(p.numel() * (WEIGHT_DTYPES[dtype] if dtype else p.element_size()) for p in model.parameters())


def median_of(rows: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


# ----------------------------------------------------------------------------- (a) anchor


def measure_copy(nbytes: int, repeats: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src).fill_(0)
    warm, fresh = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.empty_like(src).copy_(src)
        fresh.append(time.perf_counter() - start)
    seconds, fresh_seconds = statistics.median(warm[1:]), statistics.median(fresh[1:])
    return {
        "seconds": seconds,
        "gb_s": nbytes / seconds / 1e9,
        "fresh_buffer_seconds": fresh_seconds,
        "fresh_buffer_gb_s": nbytes / fresh_seconds / 1e9,
    }


# ----------------------------------------------------------------------------- (b, c) tandem


def sampler_main(conn, method: str, where: str, model_kind: str, num_rounds: int) -> None:
    """Child process: the sampler side, one round per published version."""
    model = build_model(model_kind)
    shared = method == "zmq_shared"
    source = WeightClient(where) if method.startswith("zmq") else FsWeightReader(where)
    for version in range(num_rounds):
        conn.send("ready")
        status = source.status(newer_than=version - 1, wait_s=120.0)
        assert status is not None and status.version >= version, status
        seen = time.monotonic()
        got = source.fetch(timeout_s=120.0, shared=True) if shared else source.fetch(timeout_s=120.0)
        assert got is not None, "no weights fetched"
        fetched = time.monotonic()
        manifest, flat = got
        load_weights(model, flat, manifest)
        loaded = time.monotonic()
        if shared:
            assert source.lease_held(), "the lease ran out before the load finished"
            source.release()
        marker = float(first_param(model).detach().view(-1)[0])
        conn.send(
            {
                "version": manifest.version,
                "seen": seen,
                "fetched": fetched,
                "loaded": loaded,
                "marker": marker,
            }
        )
    source.close()


def measure_method(method: str, where: str, model: torch.nn.Module, args: argparse.Namespace) -> dict:
    """Publish warm-up + `repeats` versions and time each until the sampler has loaded it."""
    run_id = new_run_id()
    if method.startswith("zmq"):
        port = free_tcp_port()
        publisher = WeightServer(f"tcp://127.0.0.1:{port}", run_id=run_id)
        address = sync_address("127.0.0.1", port)  # what a sampler on this host uses (ipc twin)
    else:
        publisher = FsWeightWriter(where, run_id=run_id, keep=2)
        address = where
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    num_rounds = args.repeats + 1
    process = ctx.Process(
        target=sampler_main,
        args=(child, method, address, args.model, num_rounds),
    )
    process.start()
    rows = []
    buffers = SnapshotBuffers(shared_prefix=shared_prefix(run_id) if method == "zmq_shared" else None)
    try:
        for version in range(num_rounds):
            assert conn.recv() == "ready"
            time.sleep(0.3)  # let the sampler park in its status wait
            with torch.no_grad():
                first_param(model).view(-1)[0] = version + 0.5  # proves this version arrived
            start = time.monotonic()
            snapshot = buffers.snapshot(  # as the trainer does: reuse buffers no fetch reads
                model.named_parameters(),
                publisher=publisher,
                version=version,
                run_id=run_id,
                dtype=args.sync_dtype,
                chunk_bytes=args.chunk_mib * 2**20,
                hashed=method == "fs",  # zmq: hashed on the first chunk fetch, as the trainer does
            )
            snapped = time.monotonic()
            publisher.publish(snapshot)
            published = time.monotonic()
            del snapshot  # the publisher holds what it needs
            got = conn.recv()
            assert got["version"] == version and got["marker"] == version + 0.5, got
            rows.append(
                {
                    "latency": got["loaded"] - start,
                    "snapshot": snapped - start,
                    "publish": published - snapped,  # zmq: hand-over only; fs: write + fsync + rename
                    "notify": got["seen"] - published,  # status long-poll (zmq) or file polling (fs)
                    "fetch": got["fetched"] - got["seen"],  # zmq: transfer + hashes; fs: read + hashes
                    "load": got["loaded"] - got["fetched"],
                }
            )
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.terminate()
        publisher.close()
        buffers.close()
    timed = median_of(rows[1:])
    return {
        **timed,
        "latency_without_notify": timed["latency"] - timed["notify"],
        "gb_s": sync_bytes(model, args.sync_dtype) / timed["latency"] / 1e9,
        "meets_target": timed["latency"] <= TARGET_SECONDS,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- (d) gloo


def gloo_main(rank: int, port: int, nbytes: int, repeats: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    flat = torch.empty(nbytes, dtype=torch.uint8).fill_(rank)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(flat, src=0)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 1:
        assert int(flat[0]) == 0
        queue.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def measure_gloo(nbytes: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_tcp_port()
    ranks = [ctx.Process(target=gloo_main, args=(r, port, nbytes, repeats, queue)) for r in (0, 1)]
    for p in ranks:
        p.start()
    seconds = queue.get(timeout=600)
    for p in ranks:
        p.join(timeout=60)
    return {"seconds": seconds, "gb_s": nbytes / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per method (after a warm-up)")
    parser.add_argument("--model", choices=("random", "embedded"), default="random")
    parser.add_argument("--sync-dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument(
        "--chunk-mib", type=int, default=CHUNK_BYTES // 2**20, help="snapshot chunk size (<= the default)"
    )
    parser.add_argument("--skip-gloo", action="store_true", help="skip the torch.distributed comparison")
    parser.add_argument("--quick", action="store_true", help="2 repeats, for a smoke test")
    add_out_arguments(parser, "weight_sync")
    args = parser.parse_args()
    args.out = results_file(args, "weight_sync")
    if args.quick:
        args.repeats = 2
    if not 0 < args.chunk_mib * 2**20 <= CHUNK_BYTES:
        parser.error(
            f"--chunk-mib must be in [1, {CHUNK_BYTES // 2**20}]: WeightClient refuses larger chunks"
        )

    model = build_model(args.model)
    num_params = sum(p.numel() for p in model.parameters())
    nbytes = sync_bytes(model, args.sync_dtype)
    results = {"copy": measure_copy(nbytes, args.repeats)}
    results["zmq"] = measure_method("zmq", "", model, args)
    if shared_prefix("x") is not None:
        results["zmq_shared"] = measure_method("zmq_shared", "", model, args)
    places = {"shm": "/dev/shm", "disk": "/tmp"} if os.path.isdir("/dev/shm") else {"disk": "/tmp"}
    for label, parent in places.items():
        with tempfile.TemporaryDirectory(prefix="tandem-weights-", dir=parent) as tmp:
            results[f"fs_{label}"] = measure_method("fs", tmp, model, args)
    if not args.skip_gloo:
        results["gloo_broadcast"] = measure_gloo(nbytes, args.repeats)

    copy_seconds = results["copy"]["seconds"]
    ratios = {
        f"{name}_vs_copy": (r["latency"] if "latency" in r else r["seconds"]) / copy_seconds
        for name, r in results.items()
        if name != "copy"
    }
    result = {
        "setting": {
            "model": args.model,
            "num_params": num_params,
            "sync_bytes": nbytes,  # one version in the sync dtype
            "sync_dtype": args.sync_dtype or "trainer's (float32)",
            "chunk_mib": args.chunk_mib,
            "repeats": args.repeats,
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        },
        "target_seconds": TARGET_SECONDS,
        "results": results,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(
        f"{num_params / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB per version; median of {args.repeats}; "
        f"target <= {TARGET_SECONDS} s sampler-visible"
    )
    copy = results["copy"]
    print(
        f"  copy anchor      {copy['seconds']:.3f} s  {copy['gb_s']:5.2f} GB/s   "
        f"(into a fresh buffer {copy['fresh_buffer_seconds']:.3f} s)"
    )
    for name in [n for n in ("zmq", "zmq_shared") if n in results] + [f"fs_{label}" for label in places]:
        r = results[name]
        print(
            f"  {name:<16} {r['latency']:.3f} s  {r['gb_s']:5.2f} GB/s   x{ratios[name + '_vs_copy']:5.1f} copy  "
            f"{'meets' if r['meets_target'] else 'MISSES'} target | snapshot {r['snapshot']:.3f} "
            f"publish {r['publish']:.3f} notify {r['notify']:.3f} fetch {r['fetch']:.3f} load {r['load']:.3f}"
        )
    if "gloo_broadcast" in results:
        g = results["gloo_broadcast"]
        print(
            f"  gloo broadcast   {g['seconds']:.3f} s  {g['gb_s']:5.2f} GB/s   "
            f"x{ratios['gloo_broadcast_vs_copy']:5.1f} copy  (bytes only)"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
