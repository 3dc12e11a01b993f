"""Byte layout of everything on a tandem socket: a versioned JSON header plus raw array frames.

This is the only module that knows the layout (DESIGN.md section 2). A `Group` travels as one
multipart ZeroMQ message:

| frame | content                                        | encoding                          |
|-------|------------------------------------------------|-----------------------------------|
| 0     | header: schema, kind, every scalar/str field,  | UTF-8 JSON object                 |
|       | metadata, and a descriptor for every array     |                                   |
| 1     | prefix_token_ids                               | int32, little-endian, raw bytes   |
| then, | per completion, in order:                      |                                   |
| +0    | generated_token_ids                            | int32, little-endian, raw bytes   |
| +1    | old_policy_log_probs                           | float32, little-endian, raw bytes |
| +2    | ref_policy_log_probs (no frame when null)      | float32, little-endian, raw bytes |

An array descriptor is `{"frame": i, "dtype": "int32" | "float32", "shape": [n]}`; frame i must
hold exactly n * itemsize bytes and descriptors name frames 1, 2, 3, ... in the order above.
`whole_token_ids` is not sent: it is `prefix_token_ids + generated_token_ids`, rebuilt by
`Group.whole_token_ids`. The header's optional `timings` object holds the sampler's seconds for
the group ({"generate", "reference", "reward"}, each finite and >= 0); a sender that predates it
leaves it out and still decodes. A completion's `reward_info` values are numbers or null (that reward
component does not apply to the sample; a reader that predates null refuses the group, naming the key).
Control messages (`encode_control`) are a single header frame.

Schema versions: 1, and 2 = 1 plus a completion's optional `policy_mask` (uint8 [n], 1 for the policy's
tokens, 0 for a tool's: agent episodes). Each message is written with the oldest version that holds it,
so only masked groups are version 2; a reader takes both and refuses a mask in a version-1 header.

Weights travel on the sync channel as one message per chunk of a flat buffer (`encode_weights_chunk`):
frame 0 a header {schema, kind: "weights", request, index, count, offset, nbytes, hash, manifest}
(the manifest, the list of tensors and chunks, rides only in chunk 0), frame 1 the chunk's raw bytes.
The trainer's status (`status_to_json`: exactly its keys, each of its type) is the payload of a
`status` control message (plus the request id) and the content of the fs method's status.json.

Why no pickle: unpickling runs code chosen by the sender, so anyone who can reach a port that
unpickles owns the process. Decoding here only parses JSON and copies raw numbers; every field
is checked against a fixed schema and any failure is a `WireError` carrying a `reason` class
(the receiver counts drops by it). Nothing in a message is ever imported, evaluated or called.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tandem.types import GROUP_TIMINGS, Completion, Group, TensorSpec, TrainerStatus, WeightsManifest

# 2 adds per-token policy masks (agent episodes, `policy_mask`). A message is written with the oldest
# version that holds it: only a group that carries masks is version 2, so single-turn groups and
# control messages are exactly as version 1 wrote them and a version-1 peer still reads them; a
# version-1 peer refuses a masked group by its version rather than train on tool tokens.
SCHEMA_VERSION = 2
BASE_SCHEMA_VERSION = 1
MASK_SCHEMA_VERSION = 2
MAX_MESSAGE_BYTES = 64 * 2**20
MAX_METADATA_DEPTH = 32
# a header describes its arrays: its JSON may be a fixed floor plus a multiple of the array bytes,
# and never above the cap (a JSON parse costs ~25x its text in memory for a bomb of empty objects)
HEADER_FLOOR_BYTES = 2**20
HEADER_PER_ARRAY_BYTE = 8
MAX_HEADER_BYTES = 8 * 2**20
MAX_HEADER_OBJECTS_PER_FRAME = (
    16  # JSON objects a group header may hold: a floor of 1024, plus this per frame
)
MAX_GROUP_FRAMES = 2 + 4 * 1024  # header, prompt ids and up to 4 arrays per completion, G <= 1024

# wire dtype -> little-endian numpy dtype; nothing outside this table is ever decoded
_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "uint8": np.dtype("u1")}
_INT32_MAX = 2**31 - 1

# the schema: exactly these keys, no more, no fewer (a change here is a SCHEMA_VERSION bump)
_GROUP_KEYS = frozenset(
    {"schema", "kind", "group_id", "prompt_id", "prefix", "prefix_tokens", "prefix_token_ids"}
    | {"policy_version", "sampler_id", "created_at", "metadata", "completions"}
)
# keys added later, which a group may leave out: a sender that predates them still decodes (and
# a reader that predates them refuses the group naming the key). `timings`: the sampler's seconds;
# `filtered`: dynamic sampling's count of groups made and not sent before this one (Group.filtered).
_GROUP_OPTIONAL_KEYS = frozenset({"timings", "filtered"})
FILTERED_NAMES = frozenset({"groups", "tokens"})
_FILTERED_MAX = 2**40  # far above any count a sampler reaches; keeps the JSON integers sane
TIMING_NAMES = frozenset(GROUP_TIMINGS)
_COMPLETION_KEYS = frozenset(
    {"text", "is_finished", "reward", "reward_info", "advantage", "generated_token_ids"}
    | {"old_policy_log_probs", "ref_policy_log_probs"}
)
# a completion's optional keys: `policy_mask` (uint8 [T], agentic episodes; Completion.policy_mask)
_COMPLETION_OPTIONAL_KEYS = frozenset({"policy_mask"})
_DESCRIPTOR_KEYS = frozenset({"frame", "dtype", "shape"})
_CONTROL_KEYS = frozenset({"schema", "kind", "payload"})
_CHUNK_KEYS = frozenset(
    {"schema", "kind", "request", "index", "count", "offset", "nbytes", "hash", "manifest"}
)
_MANIFEST_KEYS = frozenset({"version", "run_id", "total_bytes", "tensors", "chunks"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
_STATUS_KEYS = frozenset({"version", "run_id", "starved", "finished", "batches", "take_versions"})
MAX_TAKE_VERSIONS = 1024  # a trainer announces at most 256 (pacing.MAX_TAKES_ANNOUNCED)
WEIGHT_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> itemsize

# the `reason` classes of WireError, for counting dropped messages
REASONS = ("bad_header", "schema", "size", "frames", "invalid")


class WireError(ValueError):
    """A message that cannot be encoded or that fails to decode/validate.

    `reason` is a coarse class for counting drops: "bad_header" (frame 0 is not a UTF-8 JSON
    object), "schema" (wrong schema version or kind), "size" (over the byte cap), "frames"
    (frame count or frame length does not match the header), "invalid" (any other field).
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


# ----------------------------------------------------------------------------- encode


def encode_group(group: Group) -> list[bytes | memoryview]:
    """Group -> multipart frames; array frames are memoryviews of contiguous buffers (no copy).

    Log-prob tensors that are already contiguous float32 on the CPU are sent without a copy, so
    do not modify them until the send has completed. Token ids are python lists and are packed
    into int32 once. Raises WireError for anything the decoder would reject.
    """
    if not isinstance(group.metadata, dict):
        raise WireError(f"metadata must be a dict, got {_type(group.metadata)}")
    _check_json_safe(group.metadata, "metadata")
    arrays: list[memoryview] = []

    def add(array: np.ndarray) -> dict[str, Any]:
        arrays.append(memoryview(array).cast("B"))  # a flat byte view of the same memory
        return {"frame": len(arrays), "dtype": array.dtype.name, "shape": [len(array)]}

    masked = any(c.policy_mask is not None for c in group.completions)
    header = {
        "schema": MASK_SCHEMA_VERSION if masked else BASE_SCHEMA_VERSION,
        "kind": "group",
        "group_id": _check_str(group.group_id, "group_id"),
        "prompt_id": _check_str(group.prompt_id, "prompt_id"),
        "prefix": _check_str(group.prefix, "prefix"),
        "prefix_tokens": _str_list(group.prefix_tokens, "prefix_tokens"),
        "prefix_token_ids": add(_pack_token_ids(group.prefix_token_ids, "prefix_token_ids")),
        "policy_version": _check_version(group.policy_version),
        "sampler_id": _check_str(group.sampler_id, "sampler_id"),
        "created_at": _finite(group.created_at, "created_at"),
        "metadata": group.metadata,
        "timings": _timings(group.timings),
        "completions": [],
    }
    if group.filtered:  # left out when empty: a group without dynamic sampling is as before
        header["filtered"] = _filtered(group.filtered)
    for i, c in enumerate(group.completions):
        where = f"completions[{i}]"
        token_ids = _pack_token_ids(c.generated_token_ids, f"{where}.generated_token_ids")
        old = _pack_logprobs(c.old_policy_log_probs, len(token_ids), f"{where}.old_policy_log_probs")
        ref = c.ref_policy_log_probs
        ref = None if ref is None else _pack_logprobs(ref, len(token_ids), f"{where}.ref_policy_log_probs")
        entry = {
            "text": _check_str(c.text, f"{where}.text"),
            "is_finished": _check_bool(c.is_finished, f"{where}.is_finished"),
            "reward": _finite(c.reward, f"{where}.reward"),
            "reward_info": _reward_info(c.reward_info, f"{where}.reward_info"),
            "advantage": _finite(c.advantage, f"{where}.advantage"),
            "generated_token_ids": add(token_ids),
            "old_policy_log_probs": add(old),
            "ref_policy_log_probs": None if ref is None else add(ref),
        }
        if c.policy_mask is not None:  # left out for single-turn completions: those are as before
            entry["policy_mask"] = add(_pack_mask(c.policy_mask, len(token_ids), f"{where}.policy_mask"))
        header["completions"].append(entry)
    return [_dump_header(header), *arrays]


def encode_control(kind: str, payload: dict) -> list[bytes]:
    """A control message ("hello", "stop", ...): one JSON header frame, schema version 1 (unchanged)."""
    if not isinstance(kind, str) or not kind or kind == "group":
        raise WireError(f"control kind must be a non-empty str other than 'group', got {kind!r}")
    if not isinstance(payload, dict):
        raise WireError(f"control payload must be a dict, got {type(payload).__name__}")
    _check_json_safe(payload, "payload")
    return [_dump_header({"schema": BASE_SCHEMA_VERSION, "kind": kind, "payload": payload})]


def _dump_header(header: dict) -> bytes:
    try:
        text = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
    except (TypeError, ValueError) as err:  # UnicodeEncodeError (lone surrogate) is a ValueError
        raise WireError(f"header cannot be encoded as UTF-8 JSON: {err}") from err


def _pack_token_ids(token_ids: Sequence[int], where: str) -> np.ndarray:
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError) as err:  # ragged nesting
        raise WireError(f"{where} must be a flat list of ints: {err}") from err
    if array.size == 0:
        return np.zeros(0, dtype=_DTYPES["int32"])
    if array.ndim != 1 or array.dtype.kind not in "iu":  # no silent float -> int truncation
        raise WireError(f"{where} must be a flat list of ints, got {array.ndim}-D {array.dtype}")
    if array.min() < 0 or array.max() > _INT32_MAX:
        raise WireError(f"{where} must lie in [0, 2**31), got values in [{array.min()}, {array.max()}]")
    return array.astype(_DTYPES["int32"])


def _pack_mask(mask: Sequence[int], length: int, where: str) -> np.ndarray:
    array = np.asarray(mask)
    if array.shape != (length,) or (array.size and array.dtype.kind not in "iub"):
        raise WireError(
            f"{where} must be {length} zeros and ones (one per token), got {array.shape} {array.dtype}"
        )
    if array.size and not np.isin(array, (0, 1)).all():
        raise WireError(f"{where} must hold only 0 and 1")
    return array.astype(_DTYPES["uint8"])


def _pack_logprobs(values: torch.Tensor, length: int, where: str) -> np.ndarray:
    tensor = torch.as_tensor(values).detach()
    if not tensor.is_floating_point():
        raise WireError(f"{where} must be a float tensor, got {tensor.dtype}")
    if tensor.shape != (length,):
        raise WireError(f"{where} has shape {list(tensor.shape)}, expected [{length}] (one per token)")
    if not bool(torch.isfinite(tensor).all()):
        raise WireError(f"{where} contains NaN or inf")
    # no copy when the tensor is already contiguous float32 on the CPU (little-endian hosts)
    array = tensor.to("cpu", torch.float32).contiguous().numpy()
    return np.asarray(array, dtype=_DTYPES["float32"])


# ----------------------------------------------------------------------------- decode


def decode_group(frames: Sequence[Any], *, max_bytes: int = MAX_MESSAGE_BYTES) -> Group:
    """Frames (bytes, memoryview or zmq.Frame) -> Group, validating everything; else WireError.

    Arrays are copied out of the frames, so the Group holds no ZeroMQ memory.
    """
    views = _byte_views(frames, max_bytes, max_frames=MAX_GROUP_FRAMES)
    array_bytes = sum(len(v) for v in views[1:])
    header_cap = min(MAX_HEADER_BYTES, HEADER_FLOOR_BYTES + HEADER_PER_ARRAY_BYTE * array_bytes)
    if len(views[0]) > header_cap:
        raise WireError(
            f"header is {len(views[0])} bytes for {array_bytes} bytes of arrays, cap is {header_cap}", "size"
        )
    header = _load_header(views[0], max_objects=1024 + MAX_HEADER_OBJECTS_PER_FRAME * len(views))
    _check_schema(header, "group")
    _check_keys(header, _GROUP_KEYS, "header", optional=_GROUP_OPTIONAL_KEYS)

    raw_completions = header["completions"]
    if not isinstance(raw_completions, list):
        raise WireError(f"completions must be a list, got {_type(raw_completions)}")
    for i, c in enumerate(raw_completions):
        if not isinstance(c, dict):
            raise WireError(f"completions[{i}] must be an object, got {_type(c)}")
        _check_keys(c, _COMPLETION_KEYS, f"completions[{i}]", optional=_COMPLETION_OPTIONAL_KEYS)
        if "policy_mask" in c and header["schema"] < MASK_SCHEMA_VERSION:
            raise WireError(
                f"completions[{i}] has a policy_mask in a schema {header['schema']} message; masks are "
                f"schema {MASK_SCHEMA_VERSION}",
                "schema",
            )

    # every array descriptor in frame order, with the dtype its field requires
    slots = [("prefix_token_ids", header["prefix_token_ids"], "int32")]
    for i, c in enumerate(raw_completions):
        slots.append((f"completions[{i}].generated_token_ids", c["generated_token_ids"], "int32"))
        slots.append((f"completions[{i}].old_policy_log_probs", c["old_policy_log_probs"], "float32"))
        if c["ref_policy_log_probs"] is not None:
            slots.append((f"completions[{i}].ref_policy_log_probs", c["ref_policy_log_probs"], "float32"))
        if "policy_mask" in c:
            slots.append((f"completions[{i}].policy_mask", c["policy_mask"], "uint8"))
    arrays = _read_arrays(slots, views, max_bytes)

    prefix_ids = _token_ids(arrays["prefix_token_ids"], "prefix_token_ids")
    completions = [_completion(c, i, arrays) for i, c in enumerate(raw_completions)]
    metadata = header["metadata"]
    if not isinstance(metadata, dict):
        raise WireError(f"metadata must be an object, got {_type(metadata)}")
    _check_json_safe(metadata, "metadata")
    return Group(
        group_id=_check_str(header["group_id"], "group_id"),
        prompt_id=_check_str(header["prompt_id"], "prompt_id"),
        prefix=_check_str(header["prefix"], "prefix"),
        prefix_token_ids=prefix_ids,
        completions=completions,
        policy_version=_check_version(header["policy_version"]),
        sampler_id=_check_str(header["sampler_id"], "sampler_id"),
        created_at=_finite(header["created_at"], "created_at"),
        metadata=metadata,
        prefix_tokens=_str_list(header["prefix_tokens"], "prefix_tokens"),
        timings=_timings(header.get("timings", {})),
        filtered=_filtered(header.get("filtered", {})),
    )


def decode_control(frames: Sequence[Any], *, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[str, dict]:
    """One-frame control message -> (kind, payload); WireError for anything else."""
    views = _byte_views(frames, max_bytes)
    if len(views) != 1:
        raise WireError(f"a control message has 1 frame, got {len(views)}", "frames")
    header = _load_header(views[0])
    _check_schema(header, None)
    _check_keys(header, _CONTROL_KEYS, "control header")
    kind, payload = header["kind"], header["payload"]
    if kind == "group":
        raise WireError("this is a group message, not a control message", "schema")
    if not isinstance(payload, dict):
        raise WireError(f"control payload must be an object, got {_type(payload)}")
    return kind, payload


EVAL_KIND = "eval"
MAX_EVAL_FIELDS = 64
_EVAL_KEYS = frozenset({"sampler_id", "policy_version", "fields"})


def encode_eval(sampler_id: str, policy_version: int, fields: dict) -> list[bytes]:
    """A sampler's held-out evaluation of one policy version (sampler/evaluation.py), sent to the
    trainer on the data channel as a one-frame `eval` control message: {sampler_id, policy_version,
    fields: {name: number or null}}."""
    payload = {"sampler_id": sampler_id, "policy_version": policy_version, "fields": fields}
    check_eval(payload)
    return encode_control(EVAL_KIND, payload)


def check_eval(payload: dict) -> dict:
    """An `eval` payload as the schema allows it (exactly its keys; an id of at most 256 characters, a
    version in [0, 2**31), at most MAX_EVAL_FIELDS fields named eval_* of at most 64 characters, each a
    finite number or null), else WireError. Returns the payload."""
    _check_keys(payload, _EVAL_KEYS, "eval payload")
    sampler_id, version, fields = payload["sampler_id"], payload["policy_version"], payload["fields"]
    if not isinstance(sampler_id, str) or not 0 < len(sampler_id) <= 256:
        raise WireError("eval sampler_id must be a string of 1 to 256 characters")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= _INT32_MAX:
        raise WireError(f"eval policy_version must be an int in [0, 2**31), got {_type(version)}")
    if not isinstance(fields, dict) or len(fields) > MAX_EVAL_FIELDS:
        raise WireError(f"eval fields must be an object of at most {MAX_EVAL_FIELDS} entries")
    for name, value in fields.items():
        if not (isinstance(name, str) and name.startswith("eval_") and len(name) <= 64):
            raise WireError("eval field names are eval_* of at most 64 characters")
        ok = value is None or (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
        if not ok:
            raise WireError(f"eval field {name} must be a finite number or null, got {_type(value)}")
    return payload


def _byte_views(frames: Sequence[Any], max_bytes: int, max_frames: int | None = None) -> list[memoryview]:
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise WireError(f"frames must be a list of byte buffers, got {type(frames).__name__}", "frames")
    if not frames:
        raise WireError("message has no frames", "frames")
    if max_frames is not None and len(frames) > max_frames:
        raise WireError(f"message has {len(frames)} frames, at most {max_frames}", "frames")
    views = []
    for i, frame in enumerate(frames):
        buffer = getattr(frame, "buffer", frame)  # zmq.Frame exposes its bytes as .buffer
        try:
            view = memoryview(buffer)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
        except TypeError as err:
            reason = "bad_header" if i == 0 else "frames"
            raise WireError(f"frame {i} is not a byte buffer ({type(frame).__name__})", reason) from err
        views.append(view)
    total = sum(len(v) for v in views)
    if total > max_bytes:
        raise WireError(f"message is {total} bytes, cap is {max_bytes}", "size")
    return views


def _load_header(view: memoryview, max_objects: int | None = None) -> dict:
    """Frame 0 as a JSON object; with `max_objects`, parsing stops at the first object beyond it."""
    try:
        text = str(view, "utf-8")
    except UnicodeDecodeError as err:
        raise WireError(f"header is not valid UTF-8: {err}", "bad_header") from err
    hook = _unique_keys
    if max_objects is not None:
        seen = [0]

        def hook(pairs: list[tuple[str, Any]]) -> dict:
            seen[0] += 1
            if seen[0] > max_objects:
                raise WireError(f"header holds more than {max_objects} objects", "size")
            return _unique_keys(pairs)

    try:
        header = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=hook,
        )
    except WireError:
        raise
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise WireError(f"header is not valid JSON: {err}", "bad_header") from err
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, got {_type(header)}", "bad_header")
    return header


def _reject_constant(name: str) -> float:
    raise WireError(f"header contains {name}; only finite numbers are allowed", "bad_header")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError(f"header number {text[:40]} overflows a float", "bad_header")
    return value


def _parse_int(text: str) -> int:
    if len(text) > 20:  # larger than any int64; also keeps int() off huge digit strings
        raise WireError(f"header integer with {len(text)} digits is too large", "bad_header")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        duplicates = [k for k, n in Counter(k for k, _ in pairs).items() if n > 1]
        raise WireError(f"header repeats key(s) {_short(sorted(duplicates))}", "bad_header")
    return obj


def _check_schema(header: dict, kind: str | None) -> None:
    if "schema" not in header:
        raise WireError(f"header has no 'schema' key; this build speaks schema {SCHEMA_VERSION}", "schema")
    schema = header["schema"]
    if not _is_int(schema) or not BASE_SCHEMA_VERSION <= schema <= SCHEMA_VERSION:
        raise WireError(
            f"message has schema {_short(schema)}, this build speaks schemas {BASE_SCHEMA_VERSION} to "
            f"{SCHEMA_VERSION}: run the same tandem version on the sampler and the trainer",
            "schema",
        )
    actual = header.get("kind")
    if not isinstance(actual, str) or not actual:
        raise WireError(f"header 'kind' must be a non-empty str, got {_type(actual)}", "schema")
    if kind is not None and actual != kind:
        raise WireError(f"expected a {kind!r} message, got kind {_short(actual)}", "schema")


def _timings(timings: Any) -> dict[str, float]:
    """A group's sampler seconds: at most generate/reference/reward, each finite and >= 0."""
    if not isinstance(timings, dict):
        raise WireError(f"timings must be an object, got {_type(timings)}")
    unknown = timings.keys() - TIMING_NAMES
    if unknown:
        raise WireError(f"timings has unexpected key(s) {_short(sorted(map(str, unknown))[:10])}")
    out = {}
    for name, seconds in timings.items():
        value = _finite(seconds, f"timings.{name}")
        if value < 0:
            raise WireError(f"timings.{name} is negative ({value})")
        out[name] = value
    return out


def _filtered(filtered: Any) -> dict[str, int]:
    """Dynamic sampling's counts: at most groups/tokens, each an int in [0, 2**40]."""
    if not isinstance(filtered, dict):
        raise WireError(f"filtered must be an object, got {_type(filtered)}")
    unknown = filtered.keys() - FILTERED_NAMES
    if unknown:
        raise WireError(f"filtered has unexpected key(s) {_short(sorted(map(str, unknown))[:10])}")
    out = {}
    for name, count in filtered.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= _FILTERED_MAX:
            raise WireError(f"filtered.{name} must be an int in [0, 2**40], got {_short(count)}")
        out[name] = count
    return out


def _check_keys(
    obj: dict, expected: frozenset[str], where: str, *, optional: frozenset[str] = frozenset()
) -> None:
    missing, unexpected = expected - obj.keys(), obj.keys() - expected - optional
    if missing:
        raise WireError(f"{where} is missing key(s) {sorted(missing)}")
    if unexpected:
        raise WireError(f"{where} has unexpected key(s) {_short(sorted(unexpected)[:10])}")


def _read_arrays(slots: list[tuple[str, Any, str]], views: list[memoryview], max_bytes: int) -> dict:
    """Validate every descriptor against the frames, then copy each array out."""
    sizes = []
    for index, (where, desc, dtype) in enumerate(slots, start=1):
        if not isinstance(desc, dict):
            raise WireError(f"{where} must be an array descriptor object, got {_type(desc)}")
        _check_keys(desc, _DESCRIPTOR_KEYS, where)
        if not isinstance(desc["dtype"], str) or desc["dtype"] not in _DTYPES:
            raise WireError(f"{where} has dtype {_short(desc['dtype'])}, allowed: {sorted(_DTYPES)}")
        if desc["dtype"] != dtype:
            raise WireError(f"{where} must be {dtype}, got {desc['dtype']}")
        shape = desc["shape"]
        if not (isinstance(shape, list) and len(shape) == 1 and _is_int(shape[0]) and shape[0] >= 0):
            raise WireError(f"{where} shape must be [n] with an int n >= 0, got {_short(shape)}")
        nbytes = shape[0] * _DTYPES[dtype].itemsize
        if nbytes > max_bytes:
            raise WireError(f"{where} declares {nbytes} bytes, cap is {max_bytes}", "size")
        if desc["frame"] != index or not _is_int(desc["frame"]):
            raise WireError(f"{where} names frame {_short(desc['frame'])}, expected frame {index}", "frames")
        sizes.append(nbytes)
    if sum(sizes) > max_bytes:
        raise WireError(f"header declares {sum(sizes)} array bytes, cap is {max_bytes}", "size")
    if len(views) != len(slots) + 1:
        raise WireError(
            f"header describes {len(slots)} arrays, message has {len(views) - 1} array frames", "frames"
        )
    arrays = {}
    for index, ((where, desc, dtype), nbytes) in enumerate(zip(slots, sizes), start=1):
        if len(views[index]) != nbytes:
            raise WireError(
                f"frame {index} ({where}) has {len(views[index])} bytes, expected "
                f"{desc['shape'][0]} x {_DTYPES[dtype].itemsize} = {nbytes}",
                "frames",
            )
        # copy out (astype copies): the result is native-endian, writable and owns its memory
        wire_dtype = _DTYPES[dtype]
        arrays[where] = np.frombuffer(views[index], dtype=wire_dtype).astype(wire_dtype.newbyteorder("="))
    return arrays


def _token_ids(array: np.ndarray, where: str) -> list[int]:
    if array.size and array.min() < 0:
        raise WireError(f"{where} contains a negative token id ({array.min()})")
    return array.tolist()


def _logprobs(array: np.ndarray, length: int, where: str) -> torch.Tensor:
    if array.shape[0] != length:
        raise WireError(f"{where} has {array.shape[0]} values for {length} generated tokens")
    if not np.isfinite(array).all():
        raise WireError(f"{where} contains NaN or inf")
    return torch.from_numpy(array)


def _completion(c: dict, i: int, arrays: dict) -> Completion:
    where = f"completions[{i}]"
    token_ids = _token_ids(arrays[f"{where}.generated_token_ids"], f"{where}.generated_token_ids")
    old = _logprobs(arrays[f"{where}.old_policy_log_probs"], len(token_ids), f"{where}.old_policy_log_probs")
    ref = None
    if c["ref_policy_log_probs"] is not None:
        ref = _logprobs(
            arrays[f"{where}.ref_policy_log_probs"], len(token_ids), f"{where}.ref_policy_log_probs"
        )
    mask = None
    if "policy_mask" in c:
        mask_array = arrays[f"{where}.policy_mask"]
        if mask_array.shape[0] != len(token_ids):
            raise WireError(
                f"{where}.policy_mask has {mask_array.shape[0]} values for {len(token_ids)} tokens"
            )
        if mask_array.size and mask_array.max() > 1:
            raise WireError(f"{where}.policy_mask must hold only 0 and 1")
        mask = mask_array.tolist()
    return Completion(
        policy_mask=mask,
        text=_check_str(c["text"], f"{where}.text"),
        generated_token_ids=token_ids,
        is_finished=_check_bool(c["is_finished"], f"{where}.is_finished"),
        reward=_finite(c["reward"], f"{where}.reward"),
        reward_info=_reward_info(c["reward_info"], f"{where}.reward_info"),
        old_policy_log_probs=old,
        ref_policy_log_probs=ref,
        advantage=_finite(c["advantage"], f"{where}.advantage"),
    )


# ----------------------------------------------------------------------------- field checks
# shared by encode (a sampler bug fails loudly where it happens) and decode (hostile input)


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    """repr for an error message, bounded: the value may be a hostile peer's 60 MB string."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{where} must be a str, got {_type(value)}")
    return value


def _check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise WireError(f"{where} must be a bool, got {_type(value)}")
    return bool(value)


def _check_version(value: Any) -> int:
    if not (_is_int(value) or isinstance(value, np.integer)) or not 0 <= value < 2**63:
        raise WireError(f"policy_version must be an int in [0, 2**63), got {_short(value)} ({_type(value)})")
    return int(value)


def _finite(value: Any, where: str) -> float:
    """A finite real number (bool is not a number here); numpy/torch scalars are accepted."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise WireError(f"{where} must be a finite number, got {_type(value)}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise WireError(f"{where} must be a finite number, got {value}")
    return value


def _reward_info(value: Any, where: str) -> dict[str, float | None]:
    """str -> a finite number, or null where that reward component does not apply to the sample."""
    if not isinstance(value, dict):
        raise WireError(f"{where} must be a dict of str -> number or null, got {_type(value)}")
    for key in value:
        if not isinstance(key, str):
            raise WireError(f"{where} keys must be str, got {_type(key)}")
    return {key: None if v is None else _finite(v, f"{where}[{key!r}]") for key, v in value.items()}


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise WireError(f"{where} must be a list of str, got {_type(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise WireError(f"{where}[{i}] must be a str, got {_type(item)}")
    return list(value)


def _check_json_safe(value: Any, where: str, depth: int = 0) -> None:
    """JSON types only, so that the receiver gets back exactly what was sent (no tuple->list)."""
    if depth > MAX_METADATA_DEPTH:
        raise WireError(f"{where} nests deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, (str, bool)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:  # the decoder refuses longer integers
            raise WireError(f"{where} = {_short(value)} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise WireError(f"{where} is {value}; JSON carries finite numbers only")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_safe(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{where} has a {_type(key)} key {key!r}; JSON object keys must be str")
            _check_json_safe(item, f"{where}[{key!r}]", depth + 1)
    else:
        raise WireError(
            f"{where} is a {_type(value)}; the wire carries JSON types only "
            "(dict with str keys, list, str, int, float, bool, None)"
        )


# ----------------------------------------------------------------------------- weights


def manifest_to_json(manifest: WeightsManifest) -> dict:
    return {
        "version": manifest.version,
        "run_id": manifest.run_id,
        "total_bytes": manifest.total_bytes,
        "tensors": [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset, "nbytes": t.nbytes}
            for t in manifest.tensors
        ],
        "chunks": [list(c) for c in manifest.chunks],
    }


def manifest_from_json(obj: Any) -> WeightsManifest:
    """Validate a manifest (from a chunk header or a manifest.json); WeightError-free: WireError."""
    if not isinstance(obj, dict):
        raise WireError(f"manifest must be an object, got {_type(obj)}")
    _check_keys(obj, _MANIFEST_KEYS, "manifest")
    total = obj["total_bytes"]
    if not _is_int(total) or total < 0:
        raise WireError(f"manifest.total_bytes must be an int >= 0, got {_short(total)}")
    if not isinstance(obj["tensors"], list) or not isinstance(obj["chunks"], list):
        raise WireError("manifest.tensors and manifest.chunks must be lists")
    tensors = []
    for i, t in enumerate(obj["tensors"]):
        where = f"manifest.tensors[{i}]"
        if not isinstance(t, dict):
            raise WireError(f"{where} must be an object, got {_type(t)}")
        _check_keys(t, _TENSOR_KEYS, where)
        if t["dtype"] not in WEIGHT_DTYPES:
            raise WireError(f"{where}.dtype is {_short(t['dtype'])}, allowed: {sorted(WEIGHT_DTYPES)}")
        shape = t["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise WireError(f"{where}.shape must be a list of ints >= 0, got {_short(shape)}")
        nbytes = math.prod(shape) * WEIGHT_DTYPES[t["dtype"]]
        offset = t["offset"]
        if t["nbytes"] != nbytes or not _is_int(offset) or offset < 0 or offset + nbytes > total:
            raise WireError(
                f"{where} does not fit the buffer (offset {_short(offset)}, {nbytes} bytes, total {total})"
            )
        tensors.append(
            TensorSpec(_check_str(t["name"], f"{where}.name"), t["dtype"], tuple(shape), offset, nbytes)
        )
    chunks, covered = [], 0
    for i, c in enumerate(obj["chunks"]):
        ok = isinstance(c, list) and len(c) == 3 and _is_int(c[0]) and _is_int(c[1]) and isinstance(c[2], str)
        if not ok or c[0] != covered or c[1] <= 0:
            raise WireError(
                f"manifest.chunks[{i}] must be [offset, nbytes, hash] continuing at byte {covered}"
            )
        chunks.append((c[0], c[1], c[2]))
        covered += c[1]
    if covered != total:
        raise WireError(f"manifest.chunks cover {covered} bytes of {total}")
    return WeightsManifest(
        version=_check_version(obj["version"]),
        run_id=_check_str(obj["run_id"], "manifest.run_id"),
        total_bytes=total,
        tensors=tuple(tensors),
        chunks=tuple(chunks),
    )


def encode_weights_chunk(
    manifest: WeightsManifest, index: int, data: memoryview, *, request: str
) -> list[bytes | memoryview]:
    """Chunk `index` of a published version: header frame + the chunk's bytes (sent zero-copy)."""
    offset, nbytes, digest = manifest.chunks[index]
    if len(data) != nbytes:
        raise WireError(f"chunk {index} has {len(data)} bytes, the manifest says {nbytes}")
    header = {
        "schema": BASE_SCHEMA_VERSION,
        "kind": "weights",
        "request": request,
        "index": index,
        "count": len(manifest.chunks),
        "offset": offset,
        "nbytes": nbytes,
        "hash": digest,
        "manifest": manifest_to_json(manifest) if index == 0 else None,
    }
    return [_dump_header(header), data]


def decode_weights_header(frame: Any, *, max_bytes: int) -> dict:
    """Frame 0 of a weights chunk -> its header, with a validated `manifest` on chunk 0."""
    (view,) = _byte_views([frame], max_bytes)
    header = _load_header(view)
    _check_schema(header, "weights")
    _check_keys(header, _CHUNK_KEYS, "weights header")
    for key in ("index", "count", "offset", "nbytes"):
        if not _is_int(header[key]) or header[key] < 0:
            raise WireError(f"weights header {key} must be an int >= 0, got {_short(header[key])}")
    _check_str(header["request"], "request")
    _check_str(header["hash"], "hash")
    if header["index"] == 0:
        header["manifest"] = manifest_from_json(header["manifest"])
    elif header["manifest"] is not None:
        raise WireError("only chunk 0 carries the manifest")
    return header


# ----------------------------------------------------------------------------- trainer status


def status_to_json(status: TrainerStatus) -> dict:
    """The trainer's status as samplers see it (a zmq `status` reply's payload, the fs status.json)."""
    return {
        "version": status.version,
        "run_id": status.run_id,
        "starved": status.starved,
        "finished": status.finished,
        "batches": status.batches,
        "take_versions": list(status.take_versions),
    }


def status_from_json(obj: Any) -> TrainerStatus:
    """Validate a trainer status: exactly the keys of `status_to_json`, each of its type; WireError."""
    if not isinstance(obj, dict):
        raise WireError(f"trainer status must be an object, got {_type(obj)}")
    _check_keys(obj, _STATUS_KEYS, "trainer status")
    version, batches, takes = obj["version"], obj["batches"], obj["take_versions"]
    if not _is_int(version) or version < -1:
        raise WireError(f"trainer status version must be an int >= -1, got {_short(version)}")
    if not _is_int(batches) or batches < 0:
        raise WireError(f"trainer status batches must be an int >= 0, got {_short(batches)}")
    if not isinstance(takes, list) or len(takes) > MAX_TAKE_VERSIONS or not all(_is_int(v) for v in takes):
        raise WireError(f"trainer status take_versions must be a list of at most {MAX_TAKE_VERSIONS} ints")
    return TrainerStatus(
        version=version,
        run_id=_check_str(obj["run_id"], "trainer status run_id"),
        starved=_check_bool(obj["starved"], "trainer status starved"),
        finished=_check_bool(obj["finished"], "trainer status finished"),
        batches=batches,
        take_versions=tuple(takes),
    )
