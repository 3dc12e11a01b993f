"""SFT data -> token ids with a loss mask: worked arithmetic/GSM8K answers in GRPO's prompt and format,
prompt/completion or chat-messages files, a hub data set. Segments are tokenized one by one, so a
prompt's tokens are exactly those the GRPO sampler feeds the model (`tokenizer(render_prompt(...))`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from tandem.data import gsm8k
from tandem.data.files import Rows, read_hub, read_rows
from tandem.data.gsm8k import plain_solution
from tandem.data.prompts import apply_template, build_messages, worked_shots
from tandem.types import Example

log = logging.getLogger(__name__)
WORKED_SOURCES = ("synthetic", *gsm8k.HUB_IDS)  # questions whose worked solutions become answers
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PromptStyle:
    """How GRPO renders a question (data.system_prompt, data.num_shots, data.prefill; `shots` the
    worked examples of data.shots, None = the first num_shots built-in ones)."""

    system_prompt: str
    num_shots: int
    prefill: str
    shots: list | None = None  # data/prompts.py Shot items


@dataclass
class SFTExample:
    segments: list[tuple[str, bool]]  # text pieces in order; True = the loss covers its tokens
    source: str = ""  # file:line or prompt id, for error messages


@dataclass
class EncodedExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a target (mask[0] is always 0: nothing predicts it)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


# --------------------------------------------------------------------------- examples


def worked_example(tokenizer, example: Example, style: PromptStyle) -> SFTExample:
    """The GRPO prompt of `example` and its worked answer in the rewarded format
    `<think> reasoning </think><answer> N </answer>` (the text of the DPO/RM chosen answers), cut
    after `style.prefill`: the prompt ends with the prefill, the target is what the model writes
    after it, closed by eos. A model trained on these continues straight into GRPO."""
    reasoning = plain_solution(example.metadata["solution"].rsplit("####", 1)[0])
    response = f"<think> {reasoning} </think><answer> {example.answer} </answer>"
    if not response.startswith(style.prefill):
        raise ValueError(
            f"`data.prefill` is {style.prefill!r} but worked answers start with '<think>'; "
            "set data.prefill to '<think>' (as GRPO does) or ''"
        )
    shots = style.shots if style.shots is not None else worked_shots(style.num_shots)
    prompt = (
        apply_template(tokenizer, build_messages(example.question, style.system_prompt, shots))
        + style.prefill
    )
    target = response[len(style.prefill) :] + (tokenizer.eos_token or "")
    return SFTExample([(prompt, False), (target, True)], source=example.prompt_id)


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    # the plain layout of data/prompts.py and data/preferences.py for tokenizers without a template
    text = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return text + "\nAssistant: " if generation_prompt else text


def chat_example(tokenizer, messages: list[dict], train_from: int, source: str) -> SFTExample:
    """Segments of a conversation rendered by the chat template: every assistant turn at index >=
    train_from is trained, up to and including its end-of-turn (eos) token; everything else (system,
    user, earlier turns, the template's markup) is context. Each turn is located as the text the
    template adds when the turn is appended to the conversation before it."""
    eos = tokenizer.eos_token or ""
    segments: list[tuple[str, bool]] = []
    consumed = ""  # the rendered text the segments cover so far
    for i, message in enumerate(messages):
        if i < train_from or message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[: i + 1], False)
        if not (prefix.startswith(consumed) and full.startswith(prefix)):
            raise ValueError(
                f"{source}: the chat template renders the conversation before assistant turn {i} "
                "differently once the turn is added (it rewrites earlier turns), so the turn cannot be "
                "cut out of it; train on the last assistant turn only with a {prompt, completion} row"
            )
        turn = full[len(prefix) :]
        end = turn.find(eos) if eos else -1
        if end >= 0:  # generation stops at eos: what the template writes after it is context
            turn = turn[: end + len(eos)]
        # a template that does not close the turn with eos (or the plain layout): the model must
        # still learn to stop
        target = turn if end >= 0 else turn + eos
        segments += [(prefix[len(consumed) :], False), (target, True)]
        consumed = prefix + turn
    if not segments:
        raise ValueError(f"{source}: no assistant turn to train on")
    return SFTExample([(text, trained) for text, trained in segments if text], source)


def _messages(value, where: str, key: str) -> list[dict]:
    """A string (the user's prompt, or the assistant's completion) or a list of chat messages."""
    if isinstance(value, str):
        return [{"role": "assistant" if key == "completion" else "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: `{key}` must be a string or a non-empty list of {{role, content}} messages"
        )
    messages = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(
                f"{where}: `{key}[{j}]` must be a message {{role: str, content: str}}, got {m!r:.100}"
            )
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: `{key}[{j}].role` is {m['role']!r}; use one of {', '.join(ROLES)}")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def example_from_row(tokenizer, row, where: str, style: PromptStyle) -> SFTExample:
    """One example from a row in any of these layouts:
    - {messages: [...]}: a conversation; the loss covers every assistant turn;
    - {prompt, completion}: strings (the prompt becomes a user turn) or chat messages (TRL's
      conversational layout); the loss covers the assistant turns of the completion;
    - GSM8K {question, answer}: GRPO's prompt and the worked answer (`worked_example`).
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an SFT row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        return chat_example(tokenizer, _messages(row["messages"], where, "messages"), 0, where)
    if "prompt" in row and "completion" in row:
        prompt = _messages(row["prompt"], where, "prompt")
        return chat_example(
            tokenizer, prompt + _messages(row["completion"], where, "completion"), len(prompt), where
        )
    if "question" in row and "answer" in row:
        if not (isinstance(row["question"], str) and isinstance(row["answer"], str)):
            raise ValueError(f"{where}: `question` and `answer` must be strings")
        try:
            gold = gsm8k.extract_gold(row["answer"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        example = Example(where, row["question"], gold, {"solution": row["answer"]})
        return worked_example(tokenizer, example, style)
    raise ValueError(
        f"{where}: an SFT row needs `messages`, or `prompt` and `completion`, or GSM8K's `question` "
        f"and `answer`; this one has {sorted(row)}"
    )


def _rows(source: str, split: str) -> Rows:
    """(file:line, row) pairs of a .jsonl/.parquet file or a hub data set's split."""
    path = Path(source).expanduser()
    if path.is_file():
        rows = read_rows(path)
    elif "/" in source and not path.exists():
        rows = read_hub(source, split)
    else:
        raise ValueError(
            f"SFT data {source!r} is neither 'synthetic', 'gsm8k', a .jsonl/.parquet file, nor a hub id "
            "(owner/name); fix `data.dataset` or `data.eval_dataset`"
        )
    if not rows:
        raise ValueError(f"SFT data {source!r} holds no rows")
    return rows


def load_sft_examples(
    tokenizer, source: str, split: str, *, num_examples: int, seed: int, difficulty: int, style: PromptStyle
) -> list[SFTExample]:
    """Examples of one source: "synthetic" (`num_examples` generated problems of `split`; any split
    but train is held out), "gsm8k" (the hub's split), a file or a hub id (first `num_examples`
    rows, 0 = all)."""
    if source in WORKED_SOURCES:
        examples = gsm8k.load_examples(source, split, num_examples, seed, difficulty=difficulty)
        return [worked_example(tokenizer, e, style) for e in examples]
    rows = _rows(source, split)
    rows = rows[:num_examples] if num_examples > 0 else rows
    return [example_from_row(tokenizer, row, where, style) for where, row in rows]


def load_sft_splits(
    tokenizer,
    dataset: str,
    *,
    split: str,
    num_examples: int,
    eval_dataset: str | None,
    num_eval_examples: int,
    seed: int,
    difficulty: int,
    style: PromptStyle,
) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, eval) examples. Eval comes from `eval_dataset` when given; else synthetic data's
    held-out split "eval", GSM8K's "test", or for files and hub sets a seeded held-out slice of
    min(num_eval_examples, a fifth of the rows), left out of training."""
    kw = dict(seed=seed, difficulty=difficulty, style=style)
    if eval_dataset is not None or dataset in WORKED_SOURCES:
        train = load_sft_examples(tokenizer, dataset, split, num_examples=num_examples, **kw)
        if num_eval_examples == 0:
            return train, []
        source = eval_dataset or dataset
        held_split = "eval" if source == "synthetic" else "test"  # files ignore the split
        return train, load_sft_examples(tokenizer, source, held_split, num_examples=num_eval_examples, **kw)
    rows = _rows(dataset, split)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # files are often sorted (by topic, length): hold out at random
    held = set(order[: min(num_eval_examples, len(rows) // 5)])
    train_rows = [r for i, r in enumerate(rows) if i not in held]
    train_rows = train_rows[:num_examples] if num_examples > 0 else train_rows
    eval_rows = [rows[i] for i in sorted(held)]
    return (
        [example_from_row(tokenizer, row, where, style) for where, row in train_rows],
        [example_from_row(tokenizer, row, where, style) for where, row in eval_rows],
    )


# --------------------------------------------------------------------------- tokens


def encode_example(
    tokenizer, example: SFTExample, *, max_length: int, completion_only_loss: bool = True
) -> EncodedExample:
    """Token ids (each segment tokenized alone, no special tokens added) cut to `max_length`
    from the end; the mask covers the trained segments, or every token but the first when
    `completion_only_loss` is false."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in example.segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(trained or not completion_only_loss)] * len(piece)
    ids, mask = ids[:max_length], mask[:max_length]
    if mask:
        mask[0] = 0  # no earlier token predicts the first one
    return EncodedExample(ids, mask)


def encode_examples(
    tokenizer, examples: list[SFTExample], *, max_length: int, completion_only_loss: bool, what: str
) -> list[EncodedExample]:
    """`encode_example` over a split; examples left without a target token by the cut are dropped
    (and counted in the log)."""
    encoded = [
        encode_example(tokenizer, e, max_length=max_length, completion_only_loss=completion_only_loss)
        for e in examples
    ]
    kept = [e for e in encoded if e.num_targets > 0]
    num_cut = sum(len(e.input_ids) == max_length for e in encoded)
    if num_cut:
        log.info(
            "%d of %d %s examples were cut to sft.max_length=%d tokens",
            num_cut,
            len(encoded),
            what,
            max_length,
        )
    if len(kept) < len(encoded):
        log.warning(
            "%d of %d %s examples keep no target token within sft.max_length=%d (the prompt fills it): "
            "left out; raise sft.max_length to keep them",
            len(encoded) - len(kept),
            len(encoded),
            what,
            max_length,
        )
    if encoded and not kept:
        raise ValueError(
            f"no {what} example keeps a target token within `sft.max_length`={max_length}; raise sft.max_length"
        )
    return kept
