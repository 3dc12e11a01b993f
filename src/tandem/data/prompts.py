"""Prompt rendering: system prompt, fixed few-shot worked examples, the question, the chat template.

The sampler renders each question once with `render_prompt`; the completion the model writes
continues right after `prefill` (e.g. "<think>"), so rewards see `prefill + generated text`.
"""

from __future__ import annotations

from typing import Any

# Fixed worked examples in exactly the rewarded form: <think> ... </think><answer> N </answer>.
_WORKED_SHOTS: list[tuple[str, str]] = [
    (
        "Lena has 14 pears. She buys 9 more pears at the market. How many pears does Lena have now?",
        "<think> Lena starts with 14 pears and buys 9 more, so 14 + 9 = 23. </think><answer> 23 </answer>",
    ),
    (
        "A baker makes 6 trays of rolls with 12 rolls on each tray. He sells 25 rolls. "
        "How many rolls are left?",
        "<think> The trays hold 6 * 12 = 72 rolls. After selling 25, 72 - 25 = 47 rolls are left. "
        "</think><answer> 47 </answer>",
    ),
    (
        "Omar buys 3 notebooks that cost $4 each and pays with a $20 bill. How much change does he get?",
        "<think> The notebooks cost 3 * 4 = 12 dollars. His change is 20 - 12 = 8 dollars. "
        "</think><answer> 8 </answer>",
    ),
    (
        "Tara shares 56 stickers equally among 7 friends. How many stickers does each friend get?",
        "<think> Each friend gets 56 / 7 = 8 stickers. </think><answer> 8 </answer>",
    ),
]


def worked_shots(num_shots: int) -> list[tuple[str, str]]:
    """The first `num_shots` fixed (question, ideal response) pairs."""
    if not 0 <= num_shots <= len(_WORKED_SHOTS):
        raise ValueError(f"num_shots must be between 0 and {len(_WORKED_SHOTS)}, got {num_shots}")
    return _WORKED_SHOTS[:num_shots]


def build_messages(question: str, system_prompt: str, shots: list[tuple[str, str]]) -> list[dict]:
    """Chat messages: system (omitted when `system_prompt` is empty), a user/assistant pair per
    shot, then the question as the last user turn.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for shot_question, shot_response in shots:
        messages.append({"role": "user", "content": shot_question})
        messages.append({"role": "assistant", "content": shot_response})
    messages.append({"role": "user", "content": question})
    return messages


def _plain_layout(messages: list[dict]) -> str:
    """Fallback for tokenizers without a chat template: "Role: content" lines, then "Assistant: "."""
    lines = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return "\n".join(lines) + "\nAssistant: "


def render_prompt(tokenizer: Any, question: str, system_prompt: str, num_shots: int, prefill: str) -> str:
    """The prompt text the model continues: chat template with a generation prompt, then `prefill`.

    A tokenizer without a chat template (a base model) gets the plain layout
    "System: ...\\nUser: ...\\nAssistant: ...\\nUser: <question>\\nAssistant: " instead.
    """
    messages = build_messages(question, system_prompt, worked_shots(num_shots))
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = _plain_layout(messages)
    return text + prefill
