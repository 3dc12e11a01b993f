"""Data-channel cost: group encode/decode time and socket throughput against raw ZeroMQ, in one run.

  .venv/bin/python benchmarks/transport.py [--quick] [--prompts-per-step 8] [--step-seconds 10.9]

Groups are realistic GRPO groups: G=8 completions of a 256-token prompt with 128, 512 and 2048
generated tokens, float32 old and ref log-probs, ~4 characters of text per token and the seed's
`prefix_tokens` strings. Measured side by side, so the ratios hold on any machine:
(a) `encode_group` / `decode_group` per group (µs), and their share of a GRPO step that consumes
    `prompts_per_step` groups in `step_seconds` (default: the 10.9 s colocated step measured on
    this machine); target < 1%.
(b) `GroupSender` (a spawned process) -> `GroupReceiver` (this process) over tcp://127.0.0.1 and
    ipc://, in groups/s and GB/s of payload (frame bytes; GB = 1e9 bytes).
(c) the anchors on the same transports: raw PUSH/PULL with 10 MiB zero-copy messages (the machine's
    ceiling), and raw PUSH/PULL of the very frames a group encodes to, with the same high-water marks
    (the socket cost of our message shape, without encode/decode).
Writes benchmarks/results/runs/transport-<time>.json (`--update-results`: the tracked
benchmarks/results/transport.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

from results_file import add_out_arguments, results_file  # benchmarks/results_file.py
from tandem.transport.channel import GroupReceiver, GroupSender
from tandem.transport.wire import decode_group, encode_group
from tandem.types import Completion, Group

HERE = Path(__file__).resolve().parent
NUM_COMPLETIONS = 8
PROMPT_TOKENS = 256
GENERATED_TOKENS = (128, 512, 2048)
RAW_MESSAGE_BYTES = 10 * 2**20
VOCAB_SIZE = 49152
# frequent BPE pieces, ~4 characters of text per token as in English prose
PIECES = ("Ġthe", "Ġapples", "Ċ", "Ġ3", "Ġtotal", "Ġis", "Ġ=", "Ġ12", "Ġhe", "Ġbuys", ".", "Ġeach")


def make_group(num_generated: int, *, seed: int = 0) -> Group:
    """A GRPO group as a sampler sends it: G completions of one prompt, with both log-prob arrays."""
    gen = torch.Generator().manual_seed(seed)

    def token_ids(n: int) -> list[int]:
        return torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist()

    def text(n: int) -> str:
        return "".join(PIECES[i % len(PIECES)] for i in range(n)).replace("Ġ", " ").replace("Ċ", "\n")

    completions = [
        Completion(
            text="<think>" + text(num_generated) + "</think>",
            generated_token_ids=token_ids(num_generated),
            is_finished=i % 2 == 0,
            reward=2.25 - i % 3,
            reward_info={"answer": 1.0, "format": 1.25},
            old_policy_log_probs=-torch.rand(num_generated, generator=gen),
            ref_policy_log_probs=-torch.rand(num_generated, generator=gen),
            advantage=0.5 - 0.125 * i,
        )
        for i in range(NUM_COMPLETIONS)
    ]
    return Group(
        group_id=f"s0-{seed}",
        prompt_id=f"p-{seed}",
        prefix="<|im_start|>user\n" + text(PROMPT_TOKENS) + "<|im_end|>\n",
        prefix_token_ids=token_ids(PROMPT_TOKENS),
        completions=completions,
        policy_version=3,
        sampler_id="s0",
        created_at=time.time(),
        metadata={"answer": "72", "solution": text(80) + " #### 72", "source": "gsm8k"},
        prefix_tokens=[PIECES[i % len(PIECES)] for i in range(PROMPT_TOKENS)],
    )


def payload_bytes(group: Group) -> int:
    return sum(len(frame) for frame in encode_group(group))


def per_call_seconds(fn, *, min_seconds: float, repeats: int = 5) -> float:
    """Median over `repeats` batches of the mean time per call; a batch lasts about `min_seconds`."""
    fn()  # warm-up
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds / repeats or calls < 3:
        fn()
        calls += 1
    per_batch = max(1, calls)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - start) / per_batch)
    return statistics.median(samples)


def measure_codec(num_generated: int, args: argparse.Namespace) -> dict:
    group = make_group(num_generated)
    frames = [bytes(frame) for frame in encode_group(group)]  # as received: plain byte buffers
    assert decode_group(frames).completions[0].generated_token_ids == group.completions[0].generated_token_ids
    encode_s = per_call_seconds(lambda: encode_group(group), min_seconds=args.codec_seconds)
    decode_s = per_call_seconds(lambda: decode_group(frames), min_seconds=args.codec_seconds)
    per_step = args.prompts_per_step / args.step_seconds
    return {
        "payload_bytes": sum(len(f) for f in frames),
        "header_bytes": len(frames[0]),
        "num_frames": len(frames),
        "encode_us": encode_s * 1e6,
        "decode_us": decode_s * 1e6,
        "encode_share_of_step": encode_s * per_step,  # paid on the sampler
        "decode_share_of_step": decode_s * per_step,  # paid on the trainer's rank 0
        "share_of_step": (encode_s + decode_s) * per_step,
        "encode_decode_gb_s": sum(len(f) for f in frames) / (encode_s + decode_s) / 1e9,
    }


# ----------------------------------------------------------------------------- sockets


def sender_main(conn) -> None:
    """Child process: runs send jobs the parent names, one at a time, and answers "done"."""
    groups = {n: make_group(n) for n in GENERATED_TOKENS}
    raw_message = bytes(RAW_MESSAGE_BYTES)
    while (job := conn.recv()) is not None:
        mode, address, num_generated, count = job
        if mode == "tandem":
            with GroupSender(address, sndhwm=4) as sender:
                for _ in range(count):
                    sender.send(groups[num_generated])
                conn.recv()  # close only once all arrived: ipc can drop a full queue on close (libzmq #4660)
        else:
            context = zmq.Context()
            push = context.socket(zmq.PUSH)
            if mode == "raw_frames":  # our frames, our high-water mark: the socket cost alone
                push.setsockopt(zmq.SNDHWM, 4)
                frames = [bytes(f) for f in encode_group(groups[num_generated])]
            else:
                frames = [raw_message]
            push.connect(address)
            for _ in range(count):
                push.send_multipart(frames, copy=False)
            conn.recv()
            push.close()
            context.term()
        conn.send("done")


def receive(mode: str, address: str, sender, num_generated: int, count: int, num_warmup: int) -> dict:
    """Bind, ask the sender for warm-up + `count` messages, and time the `count` after warm-up."""
    context = zmq.Context()
    if mode == "tandem":
        receiver = GroupReceiver(address, rcvhwm=8, context=context)
        bound, recv = receiver.address, lambda: receiver.recv(timeout=60.0)
    else:
        pull = context.socket(zmq.PULL)
        if mode == "raw_frames":
            pull.setsockopt(zmq.RCVHWM, 8)
        pull.bind(address)
        bound = pull.getsockopt(zmq.LAST_ENDPOINT).decode()

        def recv():
            return pull.recv_multipart(copy=False) if pull.poll(60_000) else None

    sender.send((mode, bound, num_generated, num_warmup + count))
    for i in range(num_warmup + count):
        if i == num_warmup:
            start = time.perf_counter()
        if recv() is None:
            raise TimeoutError(f"{mode} on {bound}: the sender went silent after {i} messages")
    elapsed = time.perf_counter() - start
    sender.send("received")
    if not sender.poll(60) or sender.recv() != "done":
        raise TimeoutError(f"{mode} on {bound}: the sender did not finish")
    if mode == "tandem":
        assert not receiver.dropped, receiver.dropped
        receiver.close()
    else:
        pull.close()
    context.term()
    return {"count": count, "seconds": elapsed}


def measure_sockets(codec: dict, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=sender_main, args=(child,), daemon=True)
    process.start()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for transport in ("tcp", "ipc"):
            results[transport] = {}
            for i, num_generated in enumerate(GENERATED_TOKENS):
                nbytes = codec[num_generated]["payload_bytes"]
                # enough groups for ~throughput_seconds at the slower of encode and decode
                per_group = max(codec[num_generated]["encode_us"], codec[num_generated]["decode_us"]) / 1e6
                count = int(min(max(args.throughput_seconds / per_group, 50), 50_000))
                row = {}
                for mode in ("tandem", "raw_frames"):
                    address = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp}/{mode}-{i}.sock"
                    run = receive(mode, address, parent, num_generated, count, num_warmup=20)
                    row[mode] = {
                        **run,
                        "groups_per_s": count / run["seconds"],
                        "gb_s": count * nbytes / run["seconds"] / 1e9,
                    }
                results[transport][num_generated] = row
            address = "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp}/raw.sock"
            count = args.raw_messages
            run = receive("raw_10mib", address, parent, 0, count, num_warmup=5)
            results[transport]["raw_10mib"] = {
                **run,
                "gb_s": count * RAW_MESSAGE_BYTES / run["seconds"] / 1e9,
            }
    parent.send(None)
    process.join(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts-per-step", type=int, default=8, help="groups a GRPO step consumes")
    parser.add_argument("--step-seconds", type=float, default=10.9, help="GRPO step time to compare with")
    parser.add_argument("--codec-seconds", type=float, default=2.0, help="time spent per codec measurement")
    parser.add_argument(
        "--throughput-seconds", type=float, default=3.0, help="about this long per socket run"
    )
    parser.add_argument("--raw-messages", type=int, default=300, help="10 MiB messages per raw anchor run")
    parser.add_argument("--quick", action="store_true", help="short runs, for a smoke test")
    add_out_arguments(parser, "transport")
    args = parser.parse_args()
    args.out = results_file(args, "transport")
    if args.quick:
        args.codec_seconds, args.throughput_seconds, args.raw_messages = 0.5, 0.5, 60

    codec = {n: measure_codec(n, args) for n in GENERATED_TOKENS}
    sockets = measure_sockets(codec, args)
    ratios = {}
    for transport, rows in sockets.items():
        raw = rows["raw_10mib"]["gb_s"]
        ratios[transport] = {
            n: {
                "ours_vs_raw_10mib_gb_s": rows[n]["tandem"]["gb_s"] / raw,
                "ours_vs_raw_same_frames": rows[n]["tandem"]["gb_s"] / rows[n]["raw_frames"]["gb_s"],
            }
            for n in GENERATED_TOKENS
        }
    result = {
        "setting": {
            "num_completions": NUM_COMPLETIONS,
            "prompt_tokens": PROMPT_TOKENS,
            "generated_tokens": list(GENERATED_TOKENS),
            "prompts_per_step": args.prompts_per_step,
            "step_seconds": args.step_seconds,
            "quick": args.quick,
            "zmq": zmq.zmq_version(),
        },
        "codec": codec,
        "sockets": sockets,
        "ratios": ratios,
        "target": {"share_of_step_below": 0.01},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(
        f"codec, G={NUM_COMPLETIONS}, prompt {PROMPT_TOKENS} tokens; share of a step of "
        f"{args.prompts_per_step} groups in {args.step_seconds} s (target < 1%)"
    )
    for n, c in codec.items():
        ok = "ok" if c["share_of_step"] < 0.01 else "OVER"
        print(
            f"  gen {n:5d}: {c['payload_bytes'] / 1e3:7.1f} kB  encode {c['encode_us']:8.1f} us  "
            f"decode {c['decode_us']:8.1f} us  share {100 * c['share_of_step']:.4f}% {ok}"
        )
    for transport, rows in sockets.items():
        print(f"{transport}: raw 10 MiB {rows['raw_10mib']['gb_s']:.2f} GB/s")
        for n in GENERATED_TOKENS:
            ours, raw = rows[n]["tandem"], rows[n]["raw_frames"]
            r = ratios[transport][n]
            print(
                f"  gen {n:5d}: ours {ours['groups_per_s']:8.0f} groups/s {ours['gb_s']:.3f} GB/s | "
                f"raw same frames {raw['groups_per_s']:8.0f}/s | ours/raw_frames "
                f"{r['ours_vs_raw_same_frames']:.3f}  ours/raw_10mib {r['ours_vs_raw_10mib_gb_s']:.4f}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
