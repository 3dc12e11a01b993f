"""The prompts of a GRPO/PPO run (and of `tandem eval`) from any data set.

`load_examples` is the one entry point: "synthetic" generates arithmetic problems; anything else is
read as rows (data/files.py: .jsonl, .json, .csv, .parquet, a folder saved by `datasets` or in
GSM8K's layout, a hub id) and each row becomes an `Example`:
- a row with the prompt column (`data.prompt_column`, default "prompt"): its prompt is a string or
  a list of chat messages {role, content}; every other column rides along in `Example.columns`
  (the rewards get them by name; no answer column is needed);
- else a GSM8K row {question, answer "... #### N"}: the prompt is built from the question (the math
  task's style, data/prompts.py) and the columns are the row's others plus `solution`, the gold
  final answer ("72"), which the built-in answer reward and TRL's accuracy_reward read.
The first row decides which; every row must then follow it. A bad row is a ValueError naming its
place (`file:line`) and the column at fault.
"""

from __future__ import annotations

from pathlib import Path

from tandem.data import arithmetic, gsm8k
from tandem.data.files import Rows, is_saved_dataset, read_hub, read_rows, read_saved_dataset
from tandem.data.prompts import ROLES
from tandem.types import Example


def load_examples(
    dataset: str,
    split: str,
    num_examples: int,
    seed: int,
    *,
    difficulty: int = 1,
    prompt_column: str = "prompt",
) -> list[Example]:
    """Prompts for a run: "synthetic" generates `num_examples` problems from `seed` at `difficulty`;
    anything else is read (first `num_examples` rows, 0 = all; no seed) and turned into Examples as
    the module docstring says."""
    if dataset == "synthetic":
        if num_examples <= 0:
            raise ValueError(f"dataset 'synthetic' needs num_examples > 0, got {num_examples}")
        return [
            _with_solution(ex)
            for ex in arithmetic.make_examples(num_examples, seed, split, difficulty=difficulty)
        ]
    rows = read_source(dataset, split)
    if num_examples > 0:
        rows = rows[:num_examples]
    if not rows:
        raise ValueError(f"data set {dataset!r} (split {split!r}) holds no rows")
    first = rows[0][1]
    if isinstance(first, dict) and prompt_column in first:
        name = Path(dataset).stem if Path(dataset).expanduser().exists() else dataset.replace("/", "-")
        return [
            prompt_example(row, where, prompt_column, f"{name}-{split}-{i}")
            for i, (where, row) in enumerate(rows)
        ]
    if isinstance(first, dict) and "question" in first and "answer" in first:
        return [_with_solution(ex) for ex in gsm8k.examples_from_rows(rows, split, dataset)]
    columns = sorted(first) if isinstance(first, dict) else []
    raise ValueError(
        f"{rows[0][0]}: no `{prompt_column}` column (data.prompt_column) and not GSM8K's question/answer; "
        f"the row's columns are {columns}: set data.prompt_column to the one holding the prompt"
    )


def read_source(dataset: str, split: str) -> Rows:
    """The rows `dataset` names: a file, a folder (saved by `datasets`, or GSM8K's layout with
    SPLIT.jsonl / SPLIT.parquet), GSM8K's hub id, or another hub id."""
    path = Path(dataset).expanduser()
    if path.is_file():
        return read_rows(path)
    if path.is_dir():
        if is_saved_dataset(path):
            return read_saved_dataset(path, split)
        rows: Rows = []
        for file in gsm8k.files_for(dataset, split):
            rows += read_rows(file)
        return rows
    if dataset in gsm8k.HUB_IDS:
        return gsm8k.read_gsm8k_hub(split)
    if "/" in dataset and not dataset.startswith((".", "/", "~")):
        return read_hub(dataset, split, instead="a local .jsonl/.json/.csv/.parquet file")
    raise ValueError(
        f"data set {dataset!r} is neither synthetic, gsm8k, a file or folder that exists, nor a hub id (org/name)"
    )


def check_messages(value, where: str, column: str) -> list[dict]:
    """A list of chat messages {role, content} with string contents, or a ValueError naming the
    column and the message at fault."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: column `{column}` must be a non-empty string or a list of chat messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: column `{column}`, message {i}: needs a string `content`")
        if message.get("role") not in ROLES:
            raise ValueError(
                f"{where}: column `{column}`, message {i}: role {message.get('role')!r} is not one of {ROLES}"
            )
    return [dict(message) for message in value]


def prompt_example(row: dict, where: str, column: str, prompt_id: str) -> Example:
    """An Example from a row with its own prompt (module docstring)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with a `{column}` column")
    if column not in row:
        raise ValueError(f"{where}: no `{column}` column (data.prompt_column); its columns are {sorted(row)}")
    prompt = row[column]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: column `{column}` is empty")
        question = prompt
    else:
        prompt = check_messages(prompt, where, column)
        users = [m["content"] for m in prompt if m["role"] == "user"]
        if not users:
            raise ValueError(f"{where}: column `{column}` has no user message")
        question = users[-1]
    columns = {key: value for key, value in row.items() if key != column}
    answer = columns.get("solution")
    return Example(
        prompt_id=prompt_id,
        question=question,
        answer=answer if isinstance(answer, str) else "",
        metadata={"source": where.rsplit(":", 1)[0]},
        prompt=prompt,
        columns=columns,
    )


def _with_solution(example: Example) -> Example:
    """A question-built row (synthetic, GSM8K) with its gold answer as the `solution` column."""
    return Example(
        prompt_id=example.prompt_id,
        question=example.question,
        answer=example.answer,
        metadata=example.metadata,
        prompt=None,
        columns={**example.columns, "solution": example.answer},
    )
