"""Tool calls in the policy's text, and their arguments against the tool's schema.

The Hermes / Qwen2.5 format, which most open chat templates with tools use: each call is
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` in the assistant turn. A call that
cannot be read (bad JSON, no name, arguments that are not an object, a block left open when the
turn ended) is not dropped silently: it becomes a `CallError` that the episode answers with a tool
message, as TRL and verl do, so the policy learns from its own malformed calls. Nothing here
evaluates the model's text.

Where the tokenizer carries a `response_template` (transformers' declarative response parsing), the
calls can be read with it instead (`agent.tool_call_format`: auto picks it when present).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
MAX_CALLS_PER_TURN = 16  # more are answered with one error each, not executed


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class CallError:
    kind: str  # bad_json | bad_call | too_many | unclosed | unknown_tool | bad_arguments
    message: str
    name: str = ""  # the tool named, where one was


def parse_hermes(text: str) -> list[ToolCall | CallError]:
    """Every `<tool_call>` block of an assistant turn, in order, as a call or an error."""
    found: list[ToolCall | CallError] = []
    for match in _BLOCK.finditer(text):
        found.append(_one_call(match.group(1)))
    tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text
    if OPEN in tail:  # the turn ended (eos or the token budget) inside a call
        found.append(CallError("unclosed", f"the tool call was not closed with {CLOSE}"))
    return _capped(found)


def parse_with_template(
    tokenizer: Any, text: str, prefix: str, tools: list[dict]
) -> list[ToolCall | CallError]:
    """The tool calls of an assistant turn as the tokenizer's own `response_template` reads them
    (transformers' `parse_response`, given the conversation before the turn and the tools' schemas,
    which cast the arguments). A turn the template cannot read is one `bad_json` error."""
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except Exception as err:  # noqa: BLE001 - any failure to read the turn is the model's to learn from
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [CallError("bad_json", f"the tool call could not be read ({reason})")]
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    found: list[ToolCall | CallError] = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function", call) if isinstance(call, dict) else call
        found.append(_from_object(function))
    return _capped(found)


def _capped(found: list[ToolCall | CallError]) -> list[ToolCall | CallError]:
    if len(found) <= MAX_CALLS_PER_TURN:
        return found
    extra = len(found) - MAX_CALLS_PER_TURN
    return found[:MAX_CALLS_PER_TURN] + [
        CallError("too_many", f"at most {MAX_CALLS_PER_TURN} tool calls per turn; {extra} more ignored")
    ]


def _one_call(body: str) -> ToolCall | CallError:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as err:
        return CallError("bad_json", f"the tool call is not valid JSON ({err})")
    return _from_object(data)


def _from_object(data: Any) -> ToolCall | CallError:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return CallError("bad_call", 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates/models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as err:
            return CallError(
                "bad_json", f"the arguments of {data['name']} are not valid JSON ({err})", data["name"]
            )
    if not isinstance(arguments, dict):
        return CallError("bad_call", f"the arguments of {data['name']} must be a JSON object", data["name"])
    return ToolCall(data["name"], arguments)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def check_arguments(call: ToolCall, parameters: dict) -> str | None:
    """Why `call.arguments` do not fit the tool's JSON-schema `parameters` (required names present,
    no unknown names, the JSON type of each), or None. A bool is not an integer or a number here,
    although Python would take it as one."""
    properties: dict[str, Any] = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in call.arguments]
    if missing:
        return f"{call.name} is missing argument(s) {', '.join(missing)}"
    unknown = [name for name in call.arguments if name not in properties]
    if unknown:
        return (
            f"{call.name} has no argument(s) {', '.join(unknown)}; it takes {', '.join(properties) or 'none'}"
        )
    for name, value in call.arguments.items():
        wanted = properties[name].get("type")
        if wanted is None:
            continue
        kinds = wanted if isinstance(wanted, list) else [wanted]
        if not any(_fits(value, kind) for kind in kinds):
            return f"{call.name}: argument {name} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def _fits(value: Any, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:
        return True  # a type this check does not know: the tool itself decides
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, types)
