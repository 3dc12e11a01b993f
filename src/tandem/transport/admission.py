"""What a trainer accepts from a peer: a decoded group checked against the run it is meant for.

`wire.decode_group` guarantees a well-formed message (types, shapes, finite float32 arrays).
A well-formed group can still break training — a token id past the vocabulary, an empty group,
reward_info keys that differ between completions, a float finite as a double but infinite in
float32, a lone surrogate in a text that cannot then be written, a sampler id the size of a book
that becomes a metrics key. `check_group` names the first such fault as a short reason (the
metrics key `groups_rejected_<reason>`) and a message; it never raises on any input.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from tandem.types import Group

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SAMPLER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$")
MAX_ID_CHARS = 256  # group_id, prompt_id
MAX_REWARD_COMPONENTS = 64
MAX_METADATA_BYTES = 64 * 2**10
# log-probs are <= 0; another engine's arithmetic (vLLM's, bf16) may round a certain token to +1e-6
LOGPROB_SLACK = 1e-4

REASONS = (
    "sampler_id",
    "group_size",
    "token_id",
    "length",
    "reward_info",
    "non_finite",
    "logprob",
    "text",
    "size",
)


@dataclass(frozen=True)
class GroupLimits:
    """What the run allows. `max_positions` bounds prompt + completion (the model's context)."""

    vocab_size: int
    num_generations: int
    max_new_tokens: int  # a completion's tokens (an agent run's: a whole episode's)
    max_positions: int
    length_key: str = "sampling.max_new_tokens"  # the setting behind max_new_tokens, for messages

    @property
    def max_text_chars(self) -> int:
        # a token decodes to a few characters; 32 per token leaves room for any tokenizer's worst
        return 32 * self.max_positions + 4096


class Rejected(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_group(group: Group, limits: GroupLimits) -> tuple[str, str] | None:
    """None for a group the run can train on, else (reason, message); reason is one of REASONS."""
    try:
        _check(group, limits)
    except Rejected as err:
        return err.reason, str(err)
    except Exception as err:  # a fault in the checks themselves still rejects, never raises
        return "size", f"could not be checked: {type(err).__name__}"
    return None


def _check(group: Group, limits: GroupLimits) -> None:
    if not isinstance(group.sampler_id, str) or not SAMPLER_ID.match(group.sampler_id):
        raise Rejected(
            "sampler_id",
            f"sampler_id {_show(group.sampler_id)} is not 1-64 letters, digits or ._:@- (starting alphanumeric)",
        )
    for where, value in (("group_id", group.group_id), ("prompt_id", group.prompt_id)):
        _text(value, where, MAX_ID_CHARS)
    _text(group.prefix, "prefix", limits.max_text_chars)
    if len(group.prefix_tokens) > limits.max_positions:
        raise Rejected(
            "length", f"{len(group.prefix_tokens)} prefix_tokens, the run's limit is {limits.max_positions}"
        )
    for i, token in enumerate(group.prefix_tokens):
        _text(token, f"prefix_tokens[{i}]", limits.max_text_chars)
    if len(group.completions) != limits.num_generations:
        raise Rejected(
            "group_size",
            f"{len(group.completions)} completions; the run samples sampling.num_generations={limits.num_generations}",
        )
    _token_ids(group.prefix_token_ids, "prefix_token_ids", limits.vocab_size)
    if not group.prefix_token_ids:
        raise Rejected("length", "the prefix has no tokens")
    keys = set(group.completions[0].reward_info)
    for i, c in enumerate(group.completions):
        where = f"completions[{i}]"
        n = len(c.generated_token_ids)
        if n > limits.max_new_tokens:
            raise Rejected("length", f"{where} has {n} tokens; {limits.length_key}={limits.max_new_tokens}")
        if len(group.prefix_token_ids) + n > limits.max_positions:
            raise Rejected(
                "length",
                f"{where}: prefix + completion = {len(group.prefix_token_ids) + n} tokens, "
                f"the model takes {limits.max_positions}",
            )
        _token_ids(c.generated_token_ids, f"{where}.generated_token_ids", limits.vocab_size)
        _text(c.text, f"{where}.text", limits.max_text_chars)
        for name in ("reward", "advantage"):
            _float32(getattr(c, name), f"{where}.{name}")
        if set(c.reward_info) != keys:
            raise Rejected(
                "reward_info",
                f"{where}.reward_info has keys {_show(sorted(c.reward_info))}, completions[0] has {_show(sorted(keys))}",
            )
        if len(keys) > MAX_REWARD_COMPONENTS:
            raise Rejected(
                "size", f"{where}.reward_info has {len(keys)} keys, at most {MAX_REWARD_COMPONENTS}"
            )
        for key, value in c.reward_info.items():
            _text(key, f"{where}.reward_info key", 64)
            if value is not None:  # None: the component does not apply to this sample
                _float32(value, f"{where}.reward_info[{key!r}]")
        for name in ("old_policy_log_probs", "ref_policy_log_probs"):
            _logprobs(getattr(c, name), f"{where}.{name}")
    for name, value in group.timings.items():
        _float32(value, f"timings.{name}")
    _metadata(group.metadata)


def _token_ids(ids: list[int], where: str, vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise Rejected(
            "token_id", f"{where} holds ids in [{min(ids)}, {max(ids)}]; the vocabulary has {vocab_size}"
        )


def _float32(value: Any, where: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise Rejected("non_finite", f"{where} = {_show(value)} is not a finite float32")


def _logprobs(values: torch.Tensor | None, where: str) -> None:
    if values is None:
        return
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise Rejected("non_finite", f"{where} holds NaN or inf")
    if values.numel() and float(values.max()) > LOGPROB_SLACK:
        raise Rejected("logprob", f"{where} holds a log-probability of {float(values.max()):.4g} > 0")


def _text(value: Any, where: str, max_chars: int) -> None:
    if not isinstance(value, str):
        raise Rejected("text", f"{where} is a {type(value).__name__}, not a str")
    if len(value) > max_chars:
        raise Rejected("size", f"{where} has {len(value)} characters, the run's limit is {max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected("text", f"{where} is not valid UTF-8 (a lone surrogate)") from None


def _metadata(metadata: dict) -> None:
    try:
        size = len(json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError):
        raise Rejected("text", "metadata is not valid UTF-8 JSON") from None
    if size > MAX_METADATA_BYTES:
        raise Rejected("size", f"metadata is {size} bytes, at most {MAX_METADATA_BYTES}")


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
