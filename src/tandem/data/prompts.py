"""Prompt rendering: a row's prompt (plain text, or chat messages), the configured system prompt and
worked examples ("shots"), the chat template, and the prefill.

Two kinds of rows (data/prompt_sets.py):
- built from a question (the synthetic arithmetic and GSM8K, `Example.prompt` None): the chat is
  [system, shots as user/assistant turns, the question]; their defaults are the math task's
  (DEFAULT_SYSTEM_PROMPT, one shot of data/shots/arithmetic.jsonl, prefill "<think>");
- a row's own prompt: chat messages get the configured system prompt (where they have none) and
  shots (after their system turn); plain text is continued as it is (TRL's convention), plus the
  prefill. Nothing is added that the config does not name.
The completion the model writes continues right after the prefill, so rewards see `prefill +
generated text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config import DEFAULT_SYSTEM_PROMPT, DataConfig
from tandem.data.files import read_jsonl

SHOTS_DIR = Path(__file__).parent / "shots"
BUILTIN_SHOTS = SHOTS_DIR / "arithmetic.jsonl"
MATH_PREFILL = "<think>"
ROLES = ("system", "user", "assistant", "tool")

# a shot is a (user prompt, assistant answer) pair, or a whole exchange as chat messages (user, then
# assistant and tool turns: a worked example of a tool call for agent runs)
Shot = tuple[str, str] | tuple[dict, ...]
Shots = tuple[Shot, ...]


@dataclass(frozen=True)
class PromptStyle:
    """What surrounds a row's prompt: a system prompt ("" = none), worked examples, the prefill."""

    system_prompt: str = ""
    shots: Shots = ()
    prefill: str = ""


def builtin_shots() -> list[str]:
    """The names of the shot sets that ship with tandem (data/shots/NAME.jsonl)."""
    return sorted(p.stem for p in SHOTS_DIR.glob("*.jsonl"))


def shots_path(spec: str | Path) -> Path:
    """`data.shots`: a .jsonl file, or the name of a built-in set ("arithmetic", "calculator")."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if str(spec) in builtin_shots():
        return SHOTS_DIR / f"{spec}.jsonl"
    raise ValueError(
        f"data.shots is {str(spec)!r}: no such file, nor a built-in set ({', '.join(builtin_shots())})"
    )


def load_shots(spec: str | Path) -> Shots:
    """Worked examples from a .jsonl file (or a built-in set's name): each line is
    {"prompt": str, "completion": str}, or {"messages": [...]} — a user turn followed by assistant and
    tool turns, to show a tool call and its use."""
    shots: list[Shot] = []
    for where, row in read_jsonl(shots_path(spec)):
        if isinstance(row, dict) and "messages" in row:
            shots.append(_message_shot(row["messages"], where))
        elif isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("prompt", "completion")):
            shots.append((row["prompt"], row["completion"]))
        else:
            raise ValueError(
                f'{where}: a shot is {{"prompt": "...", "completion": "..."}} (strings) or '
                '{"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}'
            )
    return tuple(shots)


def _message_shot(messages: Any, where: str) -> tuple[dict, ...]:
    fine = isinstance(messages, list) and len(messages) >= 2
    fine = fine and all(
        isinstance(m, dict) and m.get("role") in ROLES[1:] and isinstance(m.get("content"), str)
        for m in messages
    )
    if not (fine and messages[0]["role"] == "user" and messages[-1]["role"] == "assistant"):
        raise ValueError(
            f"{where}: a shot's messages are a list of {{role, content}} (roles user, assistant, tool; "
            "content a string) that starts with a user turn and ends with an assistant turn"
        )
    return tuple(dict(m) for m in messages)


def shot_turns(shot: Shot) -> list[dict]:
    """A shot as chat turns."""
    if shot and isinstance(shot[0], dict):
        return [dict(m) for m in shot]
    question, answer = shot
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def worked_shots(num_shots: int) -> list[Shot]:
    """The first `num_shots` built-in arithmetic worked examples (data/shots/arithmetic.jsonl)."""
    shots = load_shots(BUILTIN_SHOTS)
    if not 0 <= num_shots <= len(shots):
        raise ValueError(f"num_shots must be between 0 and {len(shots)}, got {num_shots}")
    return list(shots[:num_shots])


def prompt_style(data: DataConfig, *, from_question: bool) -> PromptStyle:
    """The style of one kind of row under `data.*`: explicit settings win; what is left unset (None)
    takes the math task's default for rows built from a question, and nothing for a row's own prompt.
    `data.num_shots` None means every shot of data.shots (one of the built-in ones); without
    data.shots it counts the built-in shots, which only rows built from a question get."""
    system = (
        data.system_prompt
        if data.system_prompt is not None
        else (DEFAULT_SYSTEM_PROMPT if from_question else "")
    )
    if data.shots is not None:
        shots = load_shots(data.shots)
        count = len(shots) if data.num_shots is None else data.num_shots
    elif from_question:
        shots = load_shots(BUILTIN_SHOTS)
        count = 1 if data.num_shots is None else data.num_shots
    else:  # the built-in shots are the math task's: a row's own prompt gets none of them
        shots, count = (), 0
    if count > len(shots):
        where = f"data.shots ({data.shots})" if data.shots is not None else "the built-in arithmetic shots"
        raise ValueError(f"data.num_shots is {count} but {where} hold {len(shots)}; lower it or add shots")
    prefill = data.prefill if data.prefill is not None else (MATH_PREFILL if from_question else "")
    return PromptStyle(system, shots[:count], prefill)


def build_messages(question: str, system_prompt: str, shots: Shots | list[Shot]) -> list[dict]:
    """Chat messages: system (omitted when `system_prompt` is empty), each shot's turns, then the
    question as the last user turn.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for shot in shots:
        messages += shot_turns(shot)
    messages.append({"role": "user", "content": question})
    return messages


def styled_messages(messages: list[dict], style: PromptStyle) -> list[dict]:
    """A row's chat with the style's system prompt (where the row has no system turn) and its shots
    (after the leading system turns)."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    head = list(messages[:lead])
    if not head and style.system_prompt:
        head = [{"role": "system", "content": style.system_prompt}]
    turns = [turn for shot in style.shots for turn in shot_turns(shot)]
    return head + turns + list(messages[lead:])


def example_messages(example: Any, style: PromptStyle) -> str | list[dict]:
    """The prompt as rewards receive it (TRL's `prompts`): the chat messages, or a row's plain text."""
    if example.prompt is None:
        return build_messages(example.question, style.system_prompt, style.shots)
    if isinstance(example.prompt, str):
        return example.prompt
    return styled_messages(example.prompt, style)


def _plain_layout(messages: list[dict]) -> str:
    """Fallback for tokenizers without a chat template: "Role: content" lines, then "Assistant: "."""
    lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return "\n".join(lines) + "\nAssistant: "


def apply_template(tokenizer: Any, messages: list[dict]) -> str:
    """The chat template with a generation prompt; a tokenizer without one (a base model) gets the
    plain layout "System: ...\\nUser: ...\\nAssistant: "."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _plain_layout(messages)


def render_example(tokenizer: Any, example: Any, style: PromptStyle) -> str:
    """The text the model continues for `example`: its messages through the chat template (plain
    text as it is), then the prefill."""
    prompt = example_messages(example, style)
    text = prompt if isinstance(prompt, str) else apply_template(tokenizer, prompt)
    return text + style.prefill


def render_prompt(tokenizer: Any, question: str, system_prompt: str, num_shots: int, prefill: str) -> str:
    """The math task's prompt for `question`: system prompt, the first `num_shots` built-in shots,
    the question, the chat template, then `prefill`."""
    messages = build_messages(question, system_prompt, worked_shots(num_shots))
    return apply_template(tokenizer, messages) + prefill


def set_chat_template(tokenizer: Any, spec: str | None) -> None:
    """`data.chat_template`: a Jinja template file, or the template itself, replaces the tokenizer's."""
    if spec is None:
        return
    path = Path(spec).expanduser()
    if "{" not in spec and path.is_file():
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    elif "{%" in spec or "{{" in spec:
        tokenizer.chat_template = spec
    else:
        raise ValueError(
            f"data.chat_template is {spec!r}: neither a file nor a Jinja template; give a .jinja file "
            "or the template text"
        )
