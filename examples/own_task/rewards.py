"""A reward in TRL's calling convention: called once per batch with the prompts, the completions and
every other column of the rows by name; one value per completion (None: does not apply)."""

import re

NUMBER = re.compile(r"-?\d+")


def last_number(completions, solution, **kwargs):
    """1.0 when the completion's last number is the `solution` column's ("$17$"), else 0.0; the other
    columns (`op` here) and TRL's extra arguments arrive in kwargs."""
    values = []
    for completion, gold in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text)
        values.append(1.0 if numbers and numbers[-1] == gold.strip("$") else 0.0)
    return values
