"""What one hostile message costs the trainer, side by side with what it cost before the caps.

  .venv/bin/python benchmarks/hostile_peer.py [--partial-mb 64] [--update-results]

Each case runs in a fresh child process, which reports its own peak RSS growth and seconds:
(a) header bombs: the report's header of empty objects and a header of empty lists, given to
    `wire.decode_group` (with its caps) and, as the baseline, to the plain `json.loads` an uncapped
    decoder would run on the same bytes;
(b) a message of 200k empty parts, read by a `GroupReceiver` (part by part, frames past the cap let
    go) and, as the baseline, by `recv_multipart` (every part held);
(c) a multipart message that never ends: a stranger sends `--partial-mb` MiB of parts and never the
    last one. ZeroMQ hands a message over only whole, so its parts wait inside libzmq, with no bound
    but MAXMSGSIZE per part; measured on a receiver without CURVE and with CURVE (the stranger has
    no key: its handshake fails and nothing it sends is buffered).
Writes benchmarks/results/runs/hostile_peer-<time>.json (`--update-results`: the tracked file).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import socket
import struct
import time

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py

MiB = 2**20


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _header_bomb(kind: str, header_bytes: int) -> tuple[bytes, list[bytes]]:
    """A well-formed group whose metadata is a list of empty objects/lists, `header_bytes` long."""
    from tandem.transport.wire import encode_group
    from transport import make_group  # benchmarks/transport.py

    frames = [bytes(f) for f in encode_group(make_group(128))]
    header = json.loads(frames[0])
    item = "{}" if kind == "objects" else "[]"
    count = max(1, (header_bytes - len(frames[0])) // 3)
    text = json.dumps({**header, "metadata": {}}).replace(
        '"metadata": {}', '"metadata": {"x": [' + ",".join([item] * count) + "]}"
    )
    return text.encode(), frames[1:]


def _decode_case(kind: str, header_bytes: int, capped: bool, out: mp.Queue) -> None:
    from tandem.transport.wire import WireError, decode_group

    header, arrays = _header_bomb(kind, header_bytes)
    before, start = _rss_mb(), time.perf_counter()
    result = "parsed"
    if capped:
        try:
            decode_group([header, *arrays])
        except WireError as err:
            result = f"refused ({err.reason}): {str(err)[:80]}"
    else:
        json.loads(header)
    out.put(
        {"seconds": time.perf_counter() - start, "peak_rss_growth_mb": _rss_mb() - before, "result": result}
    )


def _parts_case(capped: bool, out: mp.Queue) -> None:
    import zmq

    from tandem.transport.channel import GroupReceiver

    context = zmq.Context()
    receiver = GroupReceiver("tcp://127.0.0.1:0", context=context)
    push = context.socket(zmq.PUSH)
    push.connect(receiver.address)
    push.send_multipart([b"{}"] + [b""] * 199_999)
    time.sleep(1.0)  # all parts inside the receiver's libzmq before the clock starts
    before, start = _rss_mb(), time.perf_counter()
    if capped:
        while not receiver.dropped:
            receiver.recv(timeout=0.001)
        result = f"dropped as {dict(receiver.dropped)}"
    else:
        frames = receiver._socket.recv_multipart(copy=False)
        result = f"{len(frames)} frames held"
    out.put(
        {"seconds": time.perf_counter() - start, "peak_rss_growth_mb": _rss_mb() - before, "result": result}
    )
    push.close(linger=0)
    receiver.close()
    context.term()


def _partial_receiver(curve_dir: str | None, ready: mp.Queue, done: mp.Event, out: mp.Queue) -> None:
    import zmq

    from tandem.config import CurveConfig
    from tandem.transport.auth import start_server_auth
    from tandem.transport.channel import GroupReceiver

    context = zmq.Context()
    curve = CurveConfig()
    if curve_dir:
        curve = CurveConfig(
            server_secret_key=f"{curve_dir}/trainer.key_secret", authorized_clients=f"{curve_dir}/authorized"
        )
    auth = start_server_auth(context, curve)
    receiver = GroupReceiver("tcp://127.0.0.1:0", context=context, curve=curve, auth=auth)
    before = _rss_mb()
    ready.put(receiver.address)
    while not done.is_set():
        receiver.recv(timeout=0.1)
    out.put({"peak_rss_growth_mb": _rss_mb() - before, "refused_handshakes": auth.refused if auth else 0})
    receiver.close()
    if auth is not None:
        auth.stop()
    context.destroy(linger=0)


def _zmtp_push(host: str, port: int) -> socket.socket:
    """A raw ZMTP 3.0 peer (NULL mechanism) announcing itself as PUSH. libzmq itself would hold an
    unfinished message in the sender (its pipe is flushed on the last part); a hostile peer writes
    the frames itself, and the receiver's engine buffers each as it arrives."""
    sock = socket.create_connection((host, port), timeout=10)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
    sock.sendall(greeting)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    return sock


def _partial_case(curve_dir: str | None, megabytes: int) -> dict:
    ctx = mp.get_context("spawn")
    ready, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_partial_receiver, args=(curve_dir, ready, done, out))
    proc.start()
    address = ready.get(timeout=60)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = _zmtp_push(host, int(port))
    part = b"\x03" + struct.pack(">Q", MiB) + b"\0" * MiB  # MORE | LONG: never the last part
    start, sent = time.perf_counter(), 0
    try:
        for _ in range(megabytes):
            sock.sendall(part)
            sent += 1
    except OSError:  # the receiver hung up (CURVE: the handshake failed)
        pass
    time.sleep(3.0)  # what was sent is read by the receiver (or refused)
    done.set()
    result = out.get(timeout=60)
    proc.join(timeout=30)
    sock.close()
    return {**result, "sent_mb": sent, "seconds": time.perf_counter() - start}


def _in_child(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    result = out.get(timeout=300)
    proc.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--partial-mb", type=int, default=64, help="MiB of a never-ending message (c)")
    parser.add_argument("--bomb-mb", type=int, default=8, help="header bomb size in MiB (a)")
    add_out_arguments(parser, "hostile_peer")
    args = parser.parse_args()

    results: dict = {"machine": platform.processor() or platform.machine(), "cases": {}}
    cases = results["cases"]
    for kind in ("objects", "lists"):
        for size, label in ((args.bomb_mb * MiB, f"{args.bomb_mb} MiB"), (MiB, "1 MiB (within the cap)")):
            for capped in (False, True):
                name = f"header of empty {kind}, {label}, {'decode_group' if capped else 'json.loads'}"
                cases[name] = _in_child(_decode_case, kind, size, capped)
                print(name, cases[name], flush=True)
    for capped in (False, True):
        name = f"200k empty parts, {'GroupReceiver' if capped else 'recv_multipart'}"
        cases[name] = _in_child(_parts_case, capped)
        print(name, cases[name], flush=True)
    import tempfile

    from tandem.transport.auth import keygen

    with tempfile.TemporaryDirectory() as keys:
        keygen(keys, ["trainer", "sampler"])
        for curve in (None, keys):
            name = f"never-ending message of {args.partial_mb} MiB, {'CURVE' if curve else 'no CURVE'}"
            cases[name] = _partial_case(curve, args.partial_mb)
            print(name, cases[name], flush=True)
    path = results_file(args, "hostile_peer")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
