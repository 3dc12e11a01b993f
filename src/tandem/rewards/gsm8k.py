"""Rule-based GSM8K rewards (the seed's values): answer +1/-1, format +1.25/-1, and opt-in shaping.

`completion` is the whole assistant response as text, decoded without special tokens, with the
prefill already prepended by the caller (e.g. "<think>" + generated text). The `*_rewards` forms
score a batch in TRL's calling convention (rewards/calling.py), as the registry runs them.
Standard library only (calling.py is too).
"""

from __future__ import annotations

import math
import re

from tandem.rewards.calling import completion_text

ANSWER_CORRECT, ANSWER_WRONG = 1.0, -1.0
FORMAT_CORRECT, FORMAT_WRONG = 1.25, -1.0

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
# A number: optional sign (not after a word or digit, so "10-5" reads as 10 and 5), optional "$",
# then "1,234.5" with thousands commas, or "1234.5", or ".5". Trailing "18." reads as 18.
_NUMBER = re.compile(
    r"(?:(?<![\w.])(?P<sign>[-\u2212]))?\$?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def parse_number(text: str) -> float | None:
    """The LAST number in `text`, or None if it has none.

    The last one, because answers read "The answer is 18" or "5 + 13 = 18". Handles thousands
    commas ("1,234"), "$", decimals ("3.50" == 3.5), negatives ("-7", "-$7") and trailing units
    or words ("18 eggs", "$18.00", "18."). Not handled: fractions ("3/4" reads as 4), numbers in
    words, spaces as thousands separators.
    """
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    value = float(last["digits"].replace(",", ""))
    return -value if last["sign"] else value


def extract_answer(completion: str) -> str | None:
    """The text inside the first `<answer>...</answer>`, or None when there is none."""
    match = _ANSWER_SPAN.search(completion)
    return match.group(1) if match else None


def answer_reward(completion: str, answer: str) -> float:
    """+1.0 if the number in the first <answer>...</answer> equals the gold `answer`, else -1.0.

    Numbers compare with a relative tolerance of 1e-6 (absolute 1e-6 near zero).
    """
    gold = parse_number(answer)
    if gold is None:
        raise ValueError(f"gold answer {answer!r} is not a number")
    span = extract_answer(completion)
    predicted = parse_number(span) if span is not None else None
    if predicted is None or not math.isclose(predicted, gold, rel_tol=1e-6, abs_tol=1e-6):
        return ANSWER_WRONG
    return ANSWER_CORRECT


def format_reward(completion: str) -> float:
    """+1.25 if the completion is exactly `<think>...</think><answer>...</answer>`, else -1.0.

    Only whitespace may sit before, between and after the two blocks; each of the four tags
    appears exactly once (no nesting, no second answer); the answer holds something besides
    whitespace. The think block may be empty.
    """
    match = _FORMAT.fullmatch(completion)
    if match is None or not match["answer"].strip():
        return FORMAT_WRONG
    if any(completion.count(tag) != 1 for tag in TAGS):
        return FORMAT_WRONG
    return FORMAT_CORRECT


def format_partial_reward(completion: str) -> float:
    """Opt-in shaped format reward (reward type `format_partial`), in [-1.0, 1.25].

    -1.0 + 0.5 per tag (of the four) that appears exactly once and in the right order relative to
    the other such tags: no tags -1.0, all four in order +1.0, and the exact format of
    `format_reward` +1.25 (the last 0.25 pays for no stray text outside the blocks).
    """
    if format_reward(completion) == FORMAT_CORRECT:
        return FORMAT_CORRECT
    positions = [completion.find(tag) for tag in TAGS if completion.count(tag) == 1]
    return -1.0 + 0.5 * _longest_increasing_run(positions)


def _longest_increasing_run(values: list[int]) -> int:
    """Length of the longest strictly increasing subsequence (at most four values here)."""
    best: list[int] = []
    for i, value in enumerate(values):
        best.append(1 + max((best[j] for j in range(i) if values[j] < value), default=0))
    return max(best, default=0)


# --- the batch forms: fn(completions=..., **columns) -> one value per completion (TRL's convention)


def answer_rewards(completions: list, solution: list[str], **kwargs) -> list[float | None]:
    """`answer_reward` of each completion against its row's gold `solution` ("72").

    None where the gold is empty or holds no number: the reward does not apply to that row (as TRL's
    accuracy_reward does for a gold it cannot parse).
    """
    return [
        None if parse_number(gold or "") is None else answer_reward(completion_text(completion), gold)
        for completion, gold in zip(completions, solution, strict=True)
    ]


def format_rewards(completions: list, **kwargs) -> list[float]:
    """`format_reward` of each completion."""
    return [format_reward(completion_text(completion)) for completion in completions]


def format_partial_rewards(completions: list, **kwargs) -> list[float]:
    """`format_partial_reward` of each completion."""
    return [format_partial_reward(completion_text(completion)) for completion in completions]
