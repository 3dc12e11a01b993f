"""Wire format: round trips, zero-copy frames, strict validation, pickle payloads and fuzzing."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
import random

import numpy as np
import pytest
import torch

from tandem.transport.wire import (
    MAX_MESSAGE_BYTES,
    REASONS,
    SCHEMA_VERSION,
    WireError,
    decode_control,
    decode_group,
    encode_control,
    encode_group,
    status_from_json,
    status_to_json,
)
from tandem.types import Completion, Group, TrainerStatus


def make_group(
    num_completions: int = 3, num_tokens: int = 5, *, with_ref: bool = True, sampler_id: str = "s0"
) -> Group:
    gen = torch.Generator().manual_seed(num_completions * 1000 + num_tokens)
    completions = []
    for i in range(num_completions):
        n = num_tokens + i
        completions.append(
            Completion(
                text=f"<think> {i} + 1 </think><answer> {i + 1} </answer> é ∑ 🙂",
                generated_token_ids=list(range(100 + i, 100 + i + n)),
                is_finished=i % 2 == 0,
                reward=2.25 - i,
                reward_info={"answer": 1.0 - i, "format": 1.25},
                old_policy_log_probs=-torch.rand(n, generator=gen),
                ref_policy_log_probs=-torch.rand(n, generator=gen) if with_ref else None,
                advantage=0.5 * i - 0.25,
            )
        )
    return Group(
        group_id="g-1",
        prompt_id="p-7",
        prefix="<|im_start|>user\nWhat is 3 + 4? ünïcödé 日本<|im_end|>\n",
        prefix_token_ids=[1, 2, 3, 2**31 - 1],
        completions=completions,
        policy_version=4,
        sampler_id=sampler_id,
        created_at=1722.5,
        metadata={"answer": "7", "source": "synthetic", "nested": {"level": [1, 2.5, None, True, "x"]}},
        prefix_tokens=["<|im_start|>", "user", "Ċ", "What"],
    )


def assert_same_group(a: Group, b: Group) -> None:
    for name in ("group_id", "prompt_id", "prefix", "prefix_token_ids", "policy_version", "sampler_id"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.created_at, a.metadata, a.prefix_tokens) == (b.created_at, b.metadata, b.prefix_tokens)
    assert len(a.completions) == len(b.completions)
    for x, y in zip(a.completions, b.completions):
        assert (x.text, x.generated_token_ids, x.is_finished) == (
            y.text,
            y.generated_token_ids,
            y.is_finished,
        )
        assert (x.reward, x.reward_info, x.advantage) == (y.reward, y.reward_info, y.advantage)
        assert y.old_policy_log_probs.dtype == torch.float32
        assert torch.equal(x.old_policy_log_probs, y.old_policy_log_probs)
        if x.ref_policy_log_probs is None:
            assert y.ref_policy_log_probs is None
        else:
            assert y.ref_policy_log_probs.dtype == torch.float32
            assert torch.equal(x.ref_policy_log_probs, y.ref_policy_log_probs)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("with_ref", [True, False])
def test_round_trip_every_field(with_ref):
    group = make_group(with_ref=with_ref)
    decoded = decode_group(encode_group(group))
    assert_same_group(group, decoded)
    assert all(type(t) is int for t in decoded.prefix_token_ids + decoded.completions[0].generated_token_ids)
    assert all(type(c.reward) is float and type(c.advantage) is float for c in decoded.completions)
    assert decoded.whole_token_ids(1) == group.prefix_token_ids + group.completions[1].generated_token_ids


def test_round_trip_edge_cases():
    group = make_group(num_completions=2, num_tokens=0)
    group.completions[0].generated_token_ids = []  # an empty completion: 0 tokens, empty arrays
    group.completions[0].old_policy_log_probs = torch.zeros(0)
    group.completions[0].ref_policy_log_probs = torch.zeros(0)
    group.completions[0].text = ""
    group.completions[1].ref_policy_log_probs = None  # ref present for one completion only
    group.prefix_token_ids, group.prefix_tokens, group.metadata = [], [], {}
    assert_same_group(group, decode_group(encode_group(group)))
    empty = Group("g", "p", "", [], [], 0)  # no completions at all
    assert_same_group(empty, decode_group(encode_group(empty)))


def test_reward_info_carries_none_as_json_null():
    """None: a reward component that does not apply to the sample (rewards/registry.py)."""
    group = make_group()
    group.completions[0].reward_info = {"answer": None, "format": 1.25}
    group.completions[1].reward_info = {"answer": None, "format": None}
    frames = encode_group(group)
    header = json.loads(bytes(frames[0]))
    assert header["completions"][0]["reward_info"] == {"answer": None, "format": 1.25}
    decoded = decode_group(frames)
    assert_same_group(group, decoded)
    assert not decoded.completions[1].scored and decoded.completions[0].scored


def test_encode_accepts_other_float_dtypes_and_numpy_scalars():
    group = make_group(num_completions=1)
    c = group.completions[0]
    c.old_policy_log_probs = c.old_policy_log_probs.double().requires_grad_()
    c.reward, c.advantage, group.policy_version = np.float32(1.5), torch.tensor(0.25), np.int64(3)
    decoded = decode_group(encode_group(group))
    assert decoded.completions[0].old_policy_log_probs.dtype == torch.float32
    assert (decoded.completions[0].reward, decoded.completions[0].advantage) == (1.5, 0.25)
    assert decoded.policy_version == 3 and type(decoded.policy_version) is int


def test_decode_accepts_bytes_memoryview_and_zmq_frames():
    zmq = pytest.importorskip("zmq")
    group = make_group()
    frames = encode_group(group)
    as_bytes = [bytes(f) for f in frames]
    for variant in (as_bytes, [memoryview(f) for f in as_bytes], [zmq.Frame(f) for f in as_bytes]):
        assert_same_group(group, decode_group(variant))


def test_array_frames_are_zero_copy():
    group = make_group(num_completions=1, num_tokens=8)
    frames = encode_group(group)
    assert isinstance(frames[0], bytes)
    assert all(isinstance(f, memoryview) for f in frames[1:])
    # frames: 1 prefix ids, 2 generated ids, 3 old log-probs, 4 ref log-probs
    old = group.completions[0].old_policy_log_probs
    assert np.shares_memory(np.frombuffer(frames[3], dtype=np.float32), old.numpy())
    old[0] = -42.0  # the frame *is* the tensor's memory
    assert np.frombuffer(frames[3], dtype="<f4")[0] == -42.0


def test_decoded_group_owns_its_memory():
    group = make_group(num_completions=1)
    frames = [bytearray(f) for f in encode_group(group)]
    decoded = decode_group(frames)
    for frame in frames[1:]:
        frame[:] = b"\x00" * len(frame)
    assert_same_group(group, decoded)
    assert decoded.completions[0].old_policy_log_probs.numpy().flags.writeable


def test_header_is_small_and_independent_of_sequence_length():
    def header_bytes(num_tokens):
        group = make_group(num_completions=8, num_tokens=num_tokens)
        return len(encode_group(group)[0])

    short, long = header_bytes(10), header_bytes(10_000)
    assert long < 4096  # 8 completions with their texts, descriptors and metadata
    assert long - short < 8 * 3 * 4  # only the digits of the declared shapes differ


def test_schema_covers_every_record_field():
    # a new field on Group/Completion must be put on the wire (and SCHEMA_VERSION bumped, or the
    # key made optional); `filtered` is written only when set (dynamic sampling)
    group = make_group()
    group.filtered = {"groups": 1, "tokens": 2}
    group.completions[0].policy_mask = [1] * len(group.completions[0].generated_token_ids)
    header = json.loads(bytes(encode_group(group)[0]))
    assert set(header) == {f.name for f in dataclasses.fields(Group)} | {"schema", "kind"}
    assert set(header["completions"][0]) == {f.name for f in dataclasses.fields(Completion)}


def test_header_is_plain_json_without_whole_token_ids():
    header = json.loads(bytes(encode_group(make_group())[0]))
    assert header["schema"] == 1 and header["kind"] == "group"  # single-turn: as schema 1 wrote it
    assert "whole_token_ids" not in json.dumps(header)
    assert header["completions"][0]["old_policy_log_probs"] == {"frame": 3, "dtype": "float32", "shape": [5]}


# ----------------------------------------------------------------------------- encode errors


ENCODE_ERRORS = [
    ("metadata_object", ("metadata",), {"x": object()}, "JSON types only"),
    ("metadata_tuple", ("metadata",), {"x": (1, 2)}, "tuple"),
    ("metadata_int_key", ("metadata",), {1: "a"}, "keys must be str"),
    ("metadata_nan", ("metadata",), {"x": math.nan}, "finite"),
    ("metadata_not_dict", ("metadata",), ["a"], "metadata must be a dict"),
    ("reward_nan", ("completions", 0, "reward"), math.nan, "reward must be a finite number"),
    ("reward_str", ("completions", 0, "reward"), "1.0", "reward must be a finite number"),
    ("reward_bool", ("completions", 0, "reward"), True, "reward must be a finite number"),
    ("reward_info_nan", ("completions", 0, "reward_info"), {"a": math.inf}, "reward_info"),
    ("negative_token", ("completions", 0, "generated_token_ids"), [1, -2, 3, 4, 5], r"\[0, 2\*\*31\)"),
    ("token_too_big", ("prefix_token_ids",), [2**31], r"\[0, 2\*\*31\)"),
    ("token_not_int", ("prefix_token_ids",), ["a"], "flat list of ints"),
    ("token_float", ("prefix_token_ids",), [1, 2.5], "flat list of ints, got 1-D float64"),
    ("token_bool", ("prefix_token_ids",), [True], "flat list of ints"),
    ("token_nested", ("prefix_token_ids",), [[1], [2, 3]], "flat list of ints"),
    ("metadata_huge_int", ("metadata",), {"x": 2**64}, "64 bits"),
    (
        "logprob_length",
        ("completions", 0, "old_policy_log_probs"),
        torch.zeros(4),
        r"shape \[4\], expected \[5\]",
    ),
    ("logprob_nan", ("completions", 0, "ref_policy_log_probs"), torch.full((5,), math.nan), "NaN"),
    (
        "logprob_int",
        ("completions", 0, "old_policy_log_probs"),
        torch.zeros(5, dtype=torch.long),
        "float tensor",
    ),
    ("text_bytes", ("completions", 0, "text"), b"abc", "text must be a str"),
    ("lone_surrogate", ("completions", 0, "text"), "\ud800", "UTF-8"),
    ("version_negative", ("policy_version",), -1, "policy_version"),
    ("version_huge", ("policy_version",), 2**63, "policy_version"),
    ("prefix_tokens_int", ("prefix_tokens",), [1], r"prefix_tokens\[0\] must be a str"),
]


@pytest.mark.parametrize(
    ("path", "value", "match"), [e[1:] for e in ENCODE_ERRORS], ids=[e[0] for e in ENCODE_ERRORS]
)
def test_encode_rejects_what_decode_would_reject(path, value, match):
    group = make_group()
    obj = group
    for part in path[:-1]:
        obj = obj[part] if isinstance(part, int) else getattr(obj, part)
    setattr(obj, path[-1], value)
    with pytest.raises(WireError, match=match):
        encode_group(group)


# ----------------------------------------------------------------------------- decode errors


def _valid():
    frames = [bytes(f) for f in encode_group(make_group(num_completions=2, num_tokens=3))]
    return json.loads(frames[0]), frames


def _with_header(edit):
    """A case that edits the parsed header (in place) and re-serialises it."""

    def make():
        header, frames = _valid()
        edit(header)
        return [json.dumps(header).encode(), *frames[1:]]

    return make


def _with_frames(edit):
    def make():
        _, frames = _valid()
        return edit(frames)

    return make


def _completion(key, value):
    return _with_header(lambda h: h["completions"][0].__setitem__(key, value))


def _top(key, value):
    return _with_header(lambda h: h.__setitem__(key, value))


def _descriptor(key, field, value):
    return _with_header(lambda h: h["completions"][0][key].__setitem__(field, value))


def _patch_frame(index, array):
    def edit(frames):
        frames[index] = np.asarray(array).tobytes()
        return frames

    return _with_frames(edit)


def _header_is(raw):
    return _with_frames(lambda f: [raw, *f[1:]])


def _header_replace(old, new):
    return _with_frames(lambda f: [f[0].replace(old, new), *f[1:]])


def _huge_logprob_shapes(h):
    for c in h["completions"]:  # each array under the cap, all of them together over it
        c["old_policy_log_probs"]["shape"] = c["ref_policy_log_probs"]["shape"] = [10**7]


def _shorter_logprobs(h):
    h["completions"][0]["old_policy_log_probs"]["shape"] = [2]


_NESTED = b"[" * 100_000 + b"]" * 100_000
_TRUNCATED = r"frame 3 \(completions\[0\].old_policy_log_probs\) has 11 bytes, expected 3 x 4 = 12"

# (id, make the frames, WireError.reason, the message must match)
DECODE_ERRORS = [
    ("not_utf8", _header_is(b"\xff\xfe{"), "bad_header", "not valid UTF-8"),
    ("not_json", _header_is(b"{nope"), "bad_header", "not valid JSON"),
    ("not_object", _header_is(b"[1, 2]"), "bad_header", "must be a JSON object, got list"),
    ("nan_literal", _header_replace(b'"reward":2.25', b'"reward":NaN'), "bad_header", "NaN"),
    ("inf_overflow", _header_replace(b'"reward":2.25', b'"reward":1e999'), "bad_header", "overflows"),
    (
        "huge_int",
        _header_replace(b'"policy_version":4', b'"policy_version":' + b"9" * 5000),
        "bad_header",
        "large",
    ),
    (
        "duplicate_key",
        _header_replace(b'{"schema":1,', b'{"schema":1,"schema":1,'),
        "bad_header",
        "repeats key",
    ),
    ("deep_nesting", _header_is(_NESTED), "bad_header", "not valid JSON"),
    ("frame0_not_buffer", _header_is(12345), "bad_header", "frame 0 is not a byte buffer"),
    (
        "schema_newer",
        _top("schema", SCHEMA_VERSION + 1),
        "schema",
        f"schema {SCHEMA_VERSION + 1}, this build speaks schemas 1 to 2",
    ),
    ("schema_older", _top("schema", 0), "schema", "schema 0, this build speaks schemas 1 to 2"),
    ("schema_missing", _with_header(lambda h: h.pop("schema")), "schema", "no 'schema' key"),
    ("schema_bool", _top("schema", True), "schema", "schema True"),
    ("schema_float", _top("schema", 1.0), "schema", "schema 1.0"),
    ("wrong_kind", _top("kind", "stop"), "schema", "expected a 'group' message, got kind 'stop'"),
    (
        "missing_key",
        _with_header(lambda h: h.pop("prompt_id")),
        "invalid",
        r"missing key\(s\) \['prompt_id'\]",
    ),
    ("unexpected_key", _top("__reduce__", "os.system"), "invalid", r"unexpected key\(s\) \['__reduce__'\]"),
    (
        "completion_missing",
        _with_header(lambda h: h["completions"][1].pop("advantage")),
        "invalid",
        "missing",
    ),
    ("completion_extra", _completion("whole_token_ids", [1]), "invalid", r"completions\[0\] has unexpected"),
    ("completions_not_list", _top("completions", {}), "invalid", "completions must be a list"),
    ("completion_not_object", _top("completions", [1]), "invalid", r"completions\[0\] must be an object"),
    ("version_bool", _top("policy_version", True), "invalid", "policy_version must be an int"),
    ("version_negative", _top("policy_version", -1), "invalid", r"policy_version must be an int in \[0"),
    ("version_str", _top("policy_version", "4"), "invalid", "policy_version must be an int"),
    ("version_float", _top("policy_version", 4.0), "invalid", "policy_version must be an int"),
    ("created_at_str", _top("created_at", "now"), "invalid", "created_at must be a finite number"),
    ("group_id_null", _top("group_id", None), "invalid", "group_id must be a str, got null"),
    ("sampler_id_int", _top("sampler_id", 3), "invalid", "sampler_id must be a str"),
    ("prefix_list", _top("prefix", ["a"]), "invalid", "prefix must be a str"),
    ("prefix_tokens_str", _top("prefix_tokens", "abc"), "invalid", "prefix_tokens must be a list"),
    ("prefix_tokens_int", _top("prefix_tokens", ["a", 2]), "invalid", r"prefix_tokens\[1\] must be a str"),
    ("metadata_list", _top("metadata", []), "invalid", "metadata must be an object"),
    ("reward_str", _completion("reward", "2.25"), "invalid", r"completions\[0\].reward must be a finite"),
    ("reward_bool", _completion("reward", True), "invalid", "reward must be a finite number, got bool"),
    ("reward_null", _completion("reward", None), "invalid", "reward must be a finite number, got null"),
    ("advantage_list", _completion("advantage", [1.0]), "invalid", "advantage must be a finite number"),
    ("reward_info_list", _completion("reward_info", [1.0]), "invalid", "reward_info must be a dict"),
    ("reward_info_value", _completion("reward_info", {"a": "1"}), "invalid", r"reward_info\['a'\] must be"),
    ("is_finished_int", _completion("is_finished", 1), "invalid", "is_finished must be a bool, got int"),
    ("text_int", _completion("text", 5), "invalid", r"completions\[0\].text must be a str"),
    ("descriptor_null", _completion("generated_token_ids", None), "invalid", "descriptor object, got null"),
    ("descriptor_extra", _descriptor("generated_token_ids", "offset", 0), "invalid", "unexpected key"),
    (
        "dtype_float64",
        _descriptor("old_policy_log_probs", "dtype", "float64"),
        "invalid",
        r"'float64', allowed",
    ),
    ("dtype_object", _descriptor("old_policy_log_probs", "dtype", "object"), "invalid", "dtype 'object'"),
    ("dtype_unhashable", _descriptor("old_policy_log_probs", "dtype", ["float32"]), "invalid", "dtype"),
    ("token_dtype_float", _descriptor("generated_token_ids", "dtype", "float32"), "invalid", "must be int32"),
    ("shape_negative", _descriptor("generated_token_ids", "shape", [-1]), "invalid", "shape must be"),
    ("shape_2d", _descriptor("generated_token_ids", "shape", [1, 3]), "invalid", "shape must be"),
    ("shape_float", _descriptor("generated_token_ids", "shape", [3.0]), "invalid", "shape must be"),
    ("shape_scalar", _descriptor("generated_token_ids", "shape", 3), "invalid", "shape must be"),
    (
        "shape_huge",
        _descriptor("generated_token_ids", "shape", [10**15]),
        "size",
        "4000000000000000 bytes, cap",
    ),
    (
        "shapes_sum_huge",
        _with_header(_huge_logprob_shapes),
        "size",
        r"header declares 1600000\d\d array bytes",
    ),
    (
        "frame_index_wrong",
        _descriptor("generated_token_ids", "frame", 3),
        "frames",
        "frame 3, expected frame 2",
    ),
    ("frame_index_bool", _descriptor("generated_token_ids", "frame", True), "frames", "names frame True"),
    (
        "frame_missing",
        _with_frames(lambda f: f[:-1]),
        "frames",
        "describes 7 arrays, message has 6 array frames",
    ),
    ("frame_extra", _with_frames(lambda f: [*f, b"\x00" * 4]), "frames", "describes 7 arrays, message has 8"),
    ("only_header", _with_frames(lambda f: f[:1]), "frames", "message has 0 array frames"),
    ("no_frames", _with_frames(lambda f: []), "frames", "no frames"),
    ("frame_truncated", _with_frames(lambda f: [*f[:3], f[3][:-1], *f[4:]]), "frames", _TRUNCATED),
    (
        "frame_not_buffer",
        _with_frames(lambda f: [*f[:2], None, *f[3:]]),
        "frames",
        "frame 2 is not a byte buffer",
    ),
    ("logprobs_shorter", _with_header(_shorter_logprobs), "frames", "frame 3"),
    ("negative_token_id", _patch_frame(2, np.array([5, -1, 7], dtype="<i4")), "invalid", "negative token id"),
    (
        "negative_prefix_id",
        _patch_frame(1, np.array([-5, 1, 2, 3], dtype="<i4")),
        "invalid",
        "prefix_token_ids",
    ),
    ("logprob_nan", _patch_frame(3, np.array([0.0, math.nan, 0.0], dtype="<f4")), "invalid", "NaN or inf"),
    ("logprob_inf", _patch_frame(4, np.array([0.0, -math.inf, 0.0], dtype="<f4")), "invalid", "NaN or inf"),
]


@pytest.mark.parametrize(
    ("make", "reason", "match"), [e[1:] for e in DECODE_ERRORS], ids=[e[0] for e in DECODE_ERRORS]
)
def test_decode_rejects_with_a_precise_reason(make, reason, match):
    with pytest.raises(WireError, match=match) as info:
        decode_group(make())
    assert info.value.reason == reason


def test_logprob_length_must_match_tokens():
    # a self-consistent message (descriptor and frame agree) whose log-probs are too short
    header, frames = _valid()
    header["completions"][0]["old_policy_log_probs"]["shape"] = [2]
    frames[3] = frames[3][:8]
    with pytest.raises(WireError, match=r"old_policy_log_probs has 2 values for 3 generated tokens"):
        decode_group([json.dumps(header).encode(), *frames[1:]])


def test_message_over_the_cap_is_rejected_before_parsing():
    frames = encode_group(make_group(num_tokens=100))
    total = sum(len(memoryview(f).cast("B")) for f in frames)
    assert decode_group(frames, max_bytes=total)
    with pytest.raises(WireError, match=f"message is {total} bytes, cap is {total - 1}") as info:
        decode_group(frames, max_bytes=total - 1)
    assert info.value.reason == "size"
    assert MAX_MESSAGE_BYTES == 64 * 2**20


def test_frames_must_be_a_list():
    for frames in (b"abc", "abc", None, 3):
        with pytest.raises(WireError, match="frames must be a list"):
            decode_group(frames)


# ----------------------------------------------------------------------------- pickle payloads


class _Exploit:
    """Unpickling this opens (creates) a file: what an attacker's payload would do, harmlessly."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_is_rejected_and_never_run(tmp_path, protocol):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Exploit(control), protocol=protocol)).close()
    assert control.exists()  # the payload is live: pickle.loads would run it

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker), protocol=protocol)
    _, valid = _valid()
    for frames in ([payload], [payload, payload], [valid[0], payload], [*valid[:-1], payload]):
        with pytest.raises(WireError):
            decode_group(frames)
    with pytest.raises(WireError):
        decode_control([payload])
    assert not marker.exists()


# ----------------------------------------------------------------------------- fuzzing


def _decode_or_wire_error(frames):
    try:
        decode_group(frames, max_bytes=2**20)
    except WireError as err:
        assert err.reason in REASONS
        assert str(err)


def test_fuzz_random_frames_only_raise_wire_error():
    rng = random.Random(0)
    for _ in range(300):
        frames = [rng.randbytes(rng.choice([0, 1, 4, 12, 64, 300])) for _ in range(rng.randint(0, 6))]
        if frames and rng.random() < 0.3:  # a JSON-looking header, to get past the first checks
            frames[0] = json.dumps({"schema": 1, "kind": "group", "x": rng.random()}).encode()
        _decode_or_wire_error(frames)


def _mutate_frames(frames, rng):
    frames = list(frames)
    i = rng.randrange(len(frames))
    kind = rng.choice(["flip", "truncate", "drop", "extra", "duplicate", "swap", "empty"])
    if kind == "flip" and frames[i]:
        frame = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(frame)
    elif kind == "truncate":
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == "drop":
        frames.pop(i)
    elif kind == "extra":
        frames.insert(i, rng.randbytes(rng.randint(0, 16)))
    elif kind == "duplicate":
        frames.insert(i, frames[i])
    elif kind == "swap":
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    else:
        frames[i] = b""
    return frames


def test_fuzz_byte_level_mutations_only_raise_wire_error():
    rng = random.Random(1)
    _, frames = _valid()
    for _ in range(400):
        mutated = frames
        for _ in range(rng.randint(1, 3)):
            mutated = _mutate_frames(mutated, rng) if mutated else [rng.randbytes(8)]
        _decode_or_wire_error(mutated)


HOSTILE_VALUES = [
    None,
    True,
    False,
    -1,
    0,
    2**62,
    10**19,
    -(10**19),
    1.5,
    -0.0,
    "",
    "x" * 100,
    [],
    [-1],
    [10**15],
    {},
    {"a": 1},
]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, (*prefix, i))


def test_fuzz_structural_header_mutations_only_raise_wire_error():
    # replace any node of the header (including array descriptors) with a hostile value
    rng = random.Random(2)
    header, frames = _valid()
    paths = [p for p in _paths(header) if p]
    for _ in range(400):
        mutated = copy.deepcopy(header)
        for _ in range(rng.randint(1, 2)):
            path = rng.choice(paths)
            node = mutated
            try:
                for part in path[:-1]:
                    node = node[part]
                node[path[-1]] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier replacement removed this path
        _decode_or_wire_error([json.dumps(mutated).encode(), *frames[1:]])


# ----------------------------------------------------------------------------- control messages


def test_control_round_trip():
    frames = encode_control("hello", {"sampler_id": "s0", "policy_version": 3, "nested": {"a": [1, None]}})
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    assert decode_control(frames) == (
        "hello",
        {"sampler_id": "s0", "policy_version": 3, "nested": {"a": [1, None]}},
    )
    assert decode_control(encode_control("stop", {})) == ("stop", {})


@pytest.mark.parametrize(
    ("kind", "payload", "match"),
    [
        ("", {}, "non-empty str"),
        ("group", {}, "other than 'group'"),
        ("hello", [], "payload must be a dict"),
        ("hello", {"x": {1, 2}}, "JSON types only"),
        ("hello", {"x": math.inf}, "finite"),
    ],
)
def test_encode_control_rejects(kind, payload, match):
    with pytest.raises(WireError, match=match):
        encode_control(kind, payload)


@pytest.mark.parametrize(
    ("frames", "reason", "match"),
    [
        (
            [b'{"schema":3,"kind":"stop","payload":{}}'],
            "schema",
            "schema 3, this build speaks schemas 1 to 2",
        ),
        ([b'{"schema":1,"kind":"stop","payload":{}}', b""], "frames", "1 frame, got 2"),
        ([b'{"schema":1,"kind":"stop","payload":[]}'], "invalid", "payload must be an object"),
        ([b'{"schema":1,"kind":"stop"}'], "invalid", "missing key"),
        ([b'{"schema":1,"kind":7,"payload":{}}'], "schema", "'kind' must be a non-empty str"),
        ([b'{"schema":1,"kind":"group","payload":{}}'], "schema", "group message, not a control"),
        ([b"\x80\x04"], "bad_header", "UTF-8"),
    ],
)
def test_decode_control_rejects(frames, reason, match):
    with pytest.raises(WireError, match=match) as info:
        decode_control(frames)
    assert info.value.reason == reason


# ----------------------------------------------------------------------------- trainer status


def test_trainer_status_round_trip():
    status = TrainerStatus(7, "run-a", starved=True, finished=False, batches=3, take_versions=(7, 8, 8))
    assert status_from_json(json.loads(json.dumps(status_to_json(status)))) == status
    fresh = TrainerStatus(-1, "run-b")  # nothing published yet
    assert status_from_json(status_to_json(fresh)) == fresh


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"version": None}, "version must be an int >= -1"),
        ({"version": -2}, "version must be an int >= -1"),
        ({"version": True}, "version must be an int >= -1"),
        ({"run_id": 5}, "run_id must be a str"),
        ({"starved": 0}, "starved must be a bool"),
        ({"finished": "no"}, "finished must be a bool"),
        ({"batches": -1}, "batches must be an int >= 0"),
        ({"take_versions": [1, 2.0]}, "take_versions must be a list"),
        ({"take_versions": list(range(1025))}, "take_versions must be a list of at most 1024"),
        ({"take_versions": None}, "take_versions must be a list"),
        ({"extra": 1}, "unexpected key"),
    ],
)
def test_trainer_status_rejects_ill_typed_fields(change, match):
    obj = {**status_to_json(TrainerStatus(2, "r", batches=1, take_versions=(2, 3))), **change}
    with pytest.raises(WireError, match=match):
        status_from_json(obj)


@pytest.mark.parametrize("key", ["version", "run_id", "starved", "finished", "batches", "take_versions"])
def test_trainer_status_has_no_defaults(key):
    obj = status_to_json(TrainerStatus(2, "r"))
    del obj[key]
    with pytest.raises(WireError, match="missing key"):
        status_from_json(obj)
    with pytest.raises(WireError, match="must be an object"):
        status_from_json([])


def test_group_message_is_not_a_control_message_and_vice_versa():
    with pytest.raises(WireError, match="1 frame"):
        decode_control(encode_group(make_group()))
    with pytest.raises(WireError, match="expected a 'group' message, got kind 'stop'"):
        decode_group(encode_control("stop", {}))


def test_error_messages_stay_short_for_hostile_values():
    header, frames = _valid()
    header["completions"][0]["old_policy_log_probs"]["dtype"] = "x" * 1_000_000
    with pytest.raises(WireError, match=r"\(1000002 chars\)") as info:
        decode_group([json.dumps(header).encode(), *frames[1:]])
    assert len(str(info.value)) < 300


def test_a_groups_sampler_timings_travel_and_are_optional():
    """Each group carries its share of its sampler batch's time (decoupled rows sum them). The key
    is optional: a sender that predates it (no `timings` in the header) still decodes, with none."""
    timings = {"generate": 1.5, "reference": 0.25, "reward": 0.0}
    group = dataclasses.replace(make_group(), timings=timings)
    assert decode_group(encode_group(group)).timings == timings
    frames = encode_group(group)
    header = json.loads(bytes(frames[0]))
    del header["timings"]  # exactly what a sender that predates timings writes
    older = decode_group([json.dumps(header).encode(), *frames[1:]])
    assert older.timings == {} and older.completions[0].reward == group.completions[0].reward
    header["timings"] = {"generate": 2.0}  # a subset is fine: the trainer sums what arrived
    assert decode_group([json.dumps(header).encode(), *frames[1:]]).timings == {"generate": 2.0}


@pytest.mark.parametrize(
    "timings, match",
    [
        ({"generate": -1.0}, "negative"),
        ({"generate": float("nan")}, "finite"),
        ({"train": 1.0}, "unexpected"),
        ({"reward": "1"}, "finite"),
        ([1.0, 2.0], "must be an object"),
    ],
)
def test_bad_timings_are_rejected(timings, match):
    frames = encode_group(make_group())
    header = json.loads(bytes(frames[0]))
    header["timings"] = timings
    with pytest.raises(WireError) as err:
        decode_group([json.dumps(header).encode(), *frames[1:]])
    assert err.value.reason in ("invalid", "bad_header")  # NaN is not JSON: refused as a header
    with pytest.raises(WireError, match=match):
        encode_group(dataclasses.replace(make_group(), timings=timings))


def _bomb_header(body: str) -> bytes:
    """A group header whose metadata is `body` (a JSON value), otherwise well-formed."""
    header = json.loads(bytes(encode_group(make_group())[0]))
    text = json.dumps(header)
    return text.replace('"metadata": ' + json.dumps(header["metadata"]), '"metadata": ' + body).encode()


def test_a_header_of_many_empty_objects_is_refused_before_it_is_all_parsed():
    """The report's bomb (a header of empty objects within the 64 MB cap: 1.5 GB and 3.5 s to parse)
    stops at the object budget or the header cap, whichever comes first."""
    frames = [bytes(f) for f in encode_group(make_group())]
    few_arrays = sum(len(f) for f in frames[1:])
    # within the header cap, past the object budget
    small = _bomb_header('{"x": [' + ",".join(["{}"] * 200_000) + "]}")
    assert len(small) < 2**20
    with pytest.raises(WireError, match="more than .* objects") as err:
        decode_group([small, *frames[1:]])
    assert err.value.reason == "size"
    # past the header cap for so few array bytes (1 MiB floor + 8 per array byte)
    big = _bomb_header('{"x": [' + ",".join(["[]"] * 600_000) + "]}")
    with pytest.raises(WireError, match=f"header is {len(big)} bytes for {few_arrays} bytes of arrays"):
        decode_group([big, *frames[1:]])


def test_a_message_of_too_many_frames_is_refused_before_any_is_looked_at():
    frames = [bytes(f) for f in encode_group(make_group())]
    with pytest.raises(WireError, match="200000 frames, at most") as err:
        decode_group([frames[0], *[b""] * 199_999])
    assert err.value.reason == "frames"


# ----------------------------------------------------------------------------- episodes (agentic RL)


def test_an_episodes_policy_mask_travels_and_single_turn_completions_carry_none():
    group = make_group()
    assert "policy_mask" not in bytes(encode_group(group)[0]).decode()  # single-turn: as before
    n = len(group.completions[1].generated_token_ids)
    group.completions[1].policy_mask = [1, 1, 0, 0] + [1] * (n - 4)
    frames = encode_group(group)
    assert json.loads(bytes(frames[0]))["schema"] == 2  # a masked group is schema 2
    back = decode_group(frames)
    assert back.completions[1].policy_mask == group.completions[1].policy_mask
    assert back.completions[0].policy_mask is None and back.completions[2].policy_mask is None


def test_a_mask_in_a_schema_1_group_is_refused_and_schema_2_groups_need_no_mask():
    """Schema 2 is schema 1 plus masks: a version-1 peer would not know a mask, so a version-1 header
    holding one is refused; a version-2 header without masks decodes (a newer peer's plain group)."""
    group = make_group()
    group.completions[0].policy_mask = [1, 0] + [1] * (len(group.completions[0].generated_token_ids) - 2)
    frames = [bytes(f) for f in encode_group(group)]
    header = json.loads(frames[0])
    header["schema"] = 1
    with pytest.raises(WireError, match="policy_mask in a schema 1 message") as info:
        decode_group([json.dumps(header).encode(), *frames[1:]])
    assert info.value.reason == "schema"
    plain = [bytes(f) for f in encode_group(make_group())]
    header = json.loads(plain[0])
    header["schema"] = 2
    assert decode_group([json.dumps(header).encode(), *plain[1:]]).completions[0].policy_mask is None


@pytest.mark.parametrize(
    ("mask", "match"),
    [([1, 2, 0, 1, 1, 1], "only 0 and 1"), ([1, 0], "6 zeros and ones"), ([0.5] * 6, "zeros and ones")],
)
def test_a_bad_policy_mask_is_refused_when_sent(mask, match):
    group = make_group()
    group.completions[1].policy_mask = mask
    with pytest.raises(WireError, match=match):
        encode_group(group)


def test_a_hostile_policy_mask_is_dropped_on_arrival():
    group = make_group()
    n = len(group.completions[0].generated_token_ids)
    group.completions[0].policy_mask = [1] * n
    frames = [bytes(f) for f in encode_group(group)]
    header = json.loads(frames[0])
    frame = header["completions"][0]["policy_mask"]["frame"]
    bad = list(frames)
    bad[frame] = bytes([1, 7] + [1] * (n - 2))  # a value that is not 0 or 1
    with pytest.raises(WireError, match="only 0 and 1"):
        decode_group(bad)
    short = json.loads(frames[0])
    short["completions"][0]["policy_mask"]["shape"] = [n - 1]
    bad = [json.dumps(short).encode(), *frames[1:]]
    bad[frame] = bytes([1] * (n - 1))
    with pytest.raises(WireError, match="policy_mask has"):
        decode_group(bad)
    wrong = json.loads(frames[0])
    wrong["completions"][0]["policy_mask"]["dtype"] = "int32"
    with pytest.raises(WireError, match="must be uint8"):
        decode_group([json.dumps(wrong).encode(), *frames[1:]])
