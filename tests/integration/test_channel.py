"""Experience channel over real ZeroMQ sockets on 127.0.0.1: order, hostile peers, backpressure."""

from __future__ import annotations

import json
import pickle
import random
import time
from collections import Counter

import pytest
import torch

zmq = pytest.importorskip("zmq")

from tandem.transport.channel import GroupReceiver, GroupSender, free_tcp_port  # noqa: E402
from tandem.transport.wire import encode_control, encode_group  # noqa: E402
from tandem.types import Completion, Group  # noqa: E402

RECV_TIMEOUT_S = 5.0


def make_group(
    group_id: str, *, sampler_id: str = "s0", num_tokens: int = 4, policy_version: int = 0
) -> Group:
    completions = [
        Completion(
            text=f"completion {i} of {group_id}",
            generated_token_ids=[(7 * i + t) % 300 for t in range(num_tokens)],
            is_finished=True,
            reward=float(i),
            reward_info={"answer": float(i)},
            old_policy_log_probs=torch.full((num_tokens,), -0.5),
            ref_policy_log_probs=torch.full((num_tokens,), -0.25),
            advantage=i - 0.5,
        )
        for i in range(2)
    ]
    return Group(
        group_id, f"prompt-{group_id}", "What is 3 + 4?", [1, 2, 3], completions, policy_version, sampler_id
    )


@pytest.fixture
def closing():
    """Register senders/receivers/sockets; all are closed at teardown, newest first."""
    things = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        thing.close()


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def address():
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def raw_push(context, address, closing):
    sock = closing(context.socket(zmq.PUSH))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_round_trip_in_order(address, closing):
    receiver = closing(GroupReceiver(address))
    sender = closing(GroupSender(address))
    groups = [make_group(f"g{i}", policy_version=i) for i in range(6)]
    for group in groups:
        sender.send(group, timeout=RECV_TIMEOUT_S)
    received = [receiver.recv(timeout=RECV_TIMEOUT_S) for _ in groups]
    assert [g.group_id for g in received] == [g.group_id for g in groups]
    assert [g.policy_version for g in received] == list(range(6))
    last = received[-1]
    assert last.completions[1].generated_token_ids == groups[-1].completions[1].generated_token_ids
    assert torch.equal(
        last.completions[0].ref_policy_log_probs, groups[-1].completions[0].ref_policy_log_probs
    )
    assert receiver.recv(timeout=0.05) is None
    assert receiver.received == Counter({"s0": 6}) and not receiver.dropped
    assert receiver.address == address


class _Exploit:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_messages_are_dropped_and_counted(address, closing, context, tmp_path, caplog):
    max_bytes = 2**20
    receiver = closing(GroupReceiver(address, max_bytes=max_bytes))
    hostile = raw_push(context, address, closing)
    rng = random.Random(0)
    marker = tmp_path / "pwned"
    valid = [encode_group(make_group(f"g{i}")) for i in range(5)]
    wrong_schema = json.loads(bytes(valid[0][0]))
    wrong_schema["schema"] = 99
    # each frame is under ZMQ_MAXMSGSIZE, the whole message is over max_bytes
    too_big_in_total = [valid[0][0], *[b"\x00" * (max_bytes // 2)] * 3]
    sequence = [
        valid[0],
        [b"\xff" + rng.randbytes(200)],  # random bytes -> bad_header
        [b"\xfe" + rng.randbytes(50), rng.randbytes(300)],  # bad_header
        valid[1],
        list(valid[2][:-1]),  # truncated: last array frame missing -> frames
        [json.dumps(wrong_schema).encode(), *valid[0][1:]],  # schema
        valid[2],
        [pickle.dumps(_Exploit(marker))],  # bad_header, and never unpickled
        too_big_in_total,  # size
        encode_control("stop", {}),  # a control message on the data channel -> schema
        [*valid[3][:2], bytes(valid[3][2])[:-1], *valid[3][3:]],  # a truncated frame -> frames
        valid[3],
    ]
    for frames in sequence:
        hostile.send_multipart(frames)

    received = [receiver.recv(timeout=RECV_TIMEOUT_S) for _ in range(4)]
    assert [g.group_id for g in received] == ["g0", "g1", "g2", "g3"]
    assert receiver.dropped == Counter(bad_header=3, frames=2, schema=2, size=1)
    assert not marker.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("(bad_header, 1 so far): header is not valid UTF-8" in w for w in warnings)
    assert any("(size, 1 so far): message is" in w for w in warnings)

    # a single frame over ZMQ_MAXMSGSIZE: ZeroMQ refuses it and drops that peer's connection;
    # the receiver never sees it and keeps serving everyone else
    oversize = raw_push(context, address, closing)
    oversize.send(b"\x00" * (max_bytes + 1))
    sender = closing(GroupSender(address))
    sender.send(make_group("g4"), timeout=RECV_TIMEOUT_S)
    assert receiver.recv(timeout=RECV_TIMEOUT_S).group_id == "g4"
    assert receiver.recv(timeout=0.2) is None
    assert sum(receiver.dropped.values()) == 8
    assert receiver.received == Counter({"s0": 5})


def test_backpressure_blocks_then_times_out_without_dropping(address, closing):
    receiver = closing(GroupReceiver(address, rcvhwm=1))
    sender = closing(GroupSender(address, sndhwm=1, linger=0))
    # ~200 KB per group, so the OS socket buffers fill after a few dozen groups
    num_queued, timed_out = 0, False
    for i in range(2000):
        try:
            sender.send(make_group(f"g{i}", num_tokens=25_000), timeout=0.5)
        except TimeoutError as err:
            assert "not queued" in str(err) and address in str(err)
            timed_out = True
            break
        num_queued += 1
    assert timed_out and num_queued >= 1
    # nothing was dropped: every queued group arrives, in order, once the trainer reads
    ids = []
    while (group := receiver.recv(timeout=1.0)) is not None:
        ids.append(group.group_id)
    assert ids == [f"g{i}" for i in range(num_queued)]
    assert not receiver.dropped


def test_sender_waits_for_a_trainer_that_is_not_up_yet(address, closing):
    sender = closing(GroupSender(address, sndhwm=1, linger=0))
    num_queued = 0
    with pytest.raises(TimeoutError):
        for i in range(10):
            sender.send(make_group(f"g{i}"), timeout=0.3)
            num_queued += 1
    assert num_queued >= 1  # up to the high-water mark waits in the sender
    receiver = closing(GroupReceiver(address))
    ids = [receiver.recv(timeout=RECV_TIMEOUT_S).group_id for _ in range(num_queued)]
    assert ids == [f"g{i}" for i in range(num_queued)]


def test_two_senders_fan_in(address, closing):
    receiver = closing(GroupReceiver(address))
    senders = {name: closing(GroupSender(address)) for name in ("a", "b")}
    for i in range(3):
        for name, sender in senders.items():
            sender.send(make_group(f"{name}{i}", sampler_id=name), timeout=RECV_TIMEOUT_S)
    groups = [receiver.recv(timeout=RECV_TIMEOUT_S) for _ in range(6)]
    assert receiver.received == Counter({"a": 3, "b": 3})
    for name in senders:  # ordering holds per sender
        assert [g.group_id for g in groups if g.sampler_id == name] == [f"{name}{i}" for i in range(3)]


def test_port_in_use_is_a_clear_error(address, closing):
    closing(GroupReceiver(address))
    with pytest.raises(
        OSError,
        match=r"cannot bind the experience channel to tcp://127\.0\.0\.1:\d+: address already in use.*choose another port, e\.g\. \d+",
    ):
        GroupReceiver(address)


def test_bad_addresses_and_options(closing):
    with pytest.raises(ValueError, match="cannot connect to 'nonsense'"):
        GroupSender("nonsense")
    with pytest.raises(ValueError, match="cannot bind to 'tcp://127.0.0.1:notaport'"):
        GroupReceiver("tcp://127.0.0.1:notaport")
    with pytest.raises(ValueError, match="sndhwm must be >= 1"):
        GroupSender(sndhwm=0)
    receiver = closing(GroupReceiver("tcp://127.0.0.1:*"))  # any free port; the real one is reported
    assert receiver.address.startswith("tcp://127.0.0.1:") and not receiver.address.endswith("*")


def test_a_message_of_200k_empty_parts_is_dropped_without_holding_them(context, closing):
    """The receiver reads parts one by one and lets go of those past the group's frame cap
    (2 + 3 x G): the message is dropped as "frames", the next group still arrives."""
    from tandem.transport.admission import GroupLimits

    limits = GroupLimits(vocab_size=1000, num_generations=2, max_new_tokens=64, max_positions=2**16)
    receiver = closing(GroupReceiver("tcp://127.0.0.1:0", context=context, limits=limits))
    raw = closing(context.socket(zmq.PUSH))
    raw.connect(receiver.address)
    raw.send_multipart([b"{}"] + [b""] * 199_999)
    assert receiver.recv(timeout=RECV_TIMEOUT_S) is None  # read, dropped, never returned
    sender = closing(GroupSender(receiver.address, context=context))
    sender.send(make_group("after"))
    got = receiver.recv(timeout=RECV_TIMEOUT_S)
    assert got is not None and got.group_id == "after"
    assert receiver.dropped["frames"] == 1


def test_an_oversize_frame_closes_its_connection_and_is_counted(context, closing):
    """ZeroMQ drops a frame over max_bytes together with the connection, before tandem sees it; the
    receiver's socket monitor counts and logs the closed connection."""
    receiver = closing(GroupReceiver("tcp://127.0.0.1:0", context=context, max_bytes=4096))
    raw = closing(context.socket(zmq.PUSH))
    raw.connect(receiver.address)
    raw.send(b"x" * 100_000)
    deadline = time.monotonic() + RECV_TIMEOUT_S
    while receiver.connections_closed == 0 and time.monotonic() < deadline:
        assert receiver.recv(timeout=0.1) is None
    assert receiver.connections_closed >= 1


def test_a_samplers_evaluation_rides_the_data_channel_beside_groups(address, closing, context):
    """An `eval` message reaches the receiver's `evals` between groups; a malformed one, or another
    control kind, is dropped and counted like any bad message, and never stops the groups."""
    from tandem.transport.wire import WireError, encode_eval

    receiver = closing(GroupReceiver(address))
    sender = closing(GroupSender(address))
    sender.send(make_group("g0"), timeout=RECV_TIMEOUT_S)
    sender.send_eval("s0", 4, {"eval_accuracy": 0.5, "eval_pass_at_k": None}, timeout=RECV_TIMEOUT_S)
    raw = raw_push(context, address, closing)
    raw.send_multipart(encode_control("eval", {"sampler_id": "s0", "policy_version": -1, "fields": {}}))
    raw.send_multipart(encode_control("eval", {"sampler_id": "s0", "policy_version": 1, "fields": {"x": 1}}))
    raw.send_multipart(encode_control("stop", {}))
    raw.send_multipart(
        [
            b'{"schema": 1, "kind": "eval", "payload": {"sampler_id": "s0", "policy_version": 2, '
            b'"fields": {"eval_accuracy": NaN}}}'
        ]
    )
    sender.send(make_group("g1"), timeout=RECV_TIMEOUT_S)
    received = [receiver.recv(timeout=RECV_TIMEOUT_S) for _ in range(2)]
    assert [g.group_id for g in received] == ["g0", "g1"]
    deadline = time.monotonic() + RECV_TIMEOUT_S  # the raw socket's messages are queued apart
    while sum(receiver.dropped.values()) < 4 and time.monotonic() < deadline:
        assert receiver.recv(timeout=0.1) is None
    assert list(receiver.evals) == [
        {"sampler_id": "s0", "policy_version": 4, "fields": {"eval_accuracy": 0.5, "eval_pass_at_k": None}}
    ]
    assert sum(receiver.dropped.values()) == 4 and receiver.received["s0"] == 2
    with pytest.raises(WireError, match="eval field names"):
        encode_eval("s0", 1, {"accuracy": 1.0})
    with pytest.raises(WireError, match="finite number or null"):
        encode_eval("s0", 1, {"eval_accuracy": float("inf")})
