"""GSM8K loading: local jsonl/parquet files or folders, or the hub id `openai/gsm8k` when online.

GSM8K-format data (`question`, `answer` ending in `#### N`). The sampler reads prompts through
data/prompt_sets.py, which turns such rows into Examples here; `load_examples` is the math-only
entry point of SFT's worked solutions.
"""

from __future__ import annotations

import re
from pathlib import Path

from tandem.data import arithmetic
from tandem.data.files import Rows, read_hub, read_rows
from tandem.types import Example

HUB_IDS = ("openai/gsm8k", "gsm8k")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_gold(answer_text: str) -> str:
    """The final number after the last `####` of a GSM8K solution, commas removed ("1,200" -> "1200")."""
    if "####" not in answer_text:
        raise ValueError(f"GSM8K answer has no '#### N' line: {answer_text[-80:]!r}")
    gold = answer_text.rsplit("####", 1)[1].strip().replace(",", "")
    if not _NUMBER.fullmatch(gold):
        raise ValueError(f"GSM8K answer after '####' is not a number: {gold!r}")
    return gold


def plain_solution(solution: str) -> str:
    """A GSM8K-style solution on one line without its calculator notes:
    "4 * 12 = <<4*12=48>>48" -> "4 * 12 = 48"."""
    return " ".join(line.strip() for line in re.sub(r"<<[^>]*>>", "", solution).splitlines())


def files_for(source: str, split: str) -> list[Path]:
    """The data files that `source` (a file, or a folder holding `split`) names."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"GSM8K source {source!r} is neither a file, a folder, nor one of {HUB_IDS}")
    for folder in (path, path / "main"):  # `main/` is the layout of the hub repository
        for name in (f"{split}.jsonl", f"{split}.parquet"):
            if (folder / name).is_file():
                return [folder / name]
        shards = sorted(folder.glob(f"{split}-*.parquet"))
        if shards:
            return shards
    raise ValueError(f"no {split}.jsonl, {split}.parquet or {split}-*.parquet in {path}")


def read_gsm8k_hub(split: str) -> Rows:
    return read_hub(
        "openai/gsm8k",
        split,
        subset="main",
        instead="a local path to a GSM8K .jsonl/.parquet file or folder",
    )


def load_gsm8k(source: str, split: str = "train", limit: int = 0) -> list[Example]:
    """GSM8K rows as Examples, in file order; `limit` > 0 keeps only the first `limit`.

    `source` is a .jsonl or .parquet file (then `split` only names the prompt ids), a folder
    holding `{split}.jsonl`, `{split}.parquet` or `{split}-*.parquet`, or "openai/gsm8k".
    """
    if source in HUB_IDS and not Path(source).exists():
        labelled = read_gsm8k_hub(split)
    else:
        labelled = []
        for path in files_for(source, split):
            labelled += read_rows(path)
    if limit > 0:
        labelled = labelled[:limit]
    return examples_from_rows(labelled, split, source)


def examples_from_rows(rows: Rows, split: str, source: str) -> list[Example]:
    """GSM8K rows {question, answer "... #### N"} as Examples (the gold number in `answer`, the
    full solution in metadata; the row's other columns, `answer` included, in `columns`)."""
    examples = []
    for i, (where, row) in enumerate(rows):
        if not (
            isinstance(row, dict) and all(isinstance(row.get(key), str) for key in ("question", "answer"))
        ):
            raise ValueError(f"{where}: a GSM8K row needs string fields 'question' and 'answer'")
        try:
            gold = extract_gold(row["answer"])
        except ValueError as err:
            raise ValueError(f"{where}: column `answer`: {err}") from err
        examples.append(
            Example(
                prompt_id=f"gsm8k-{split}-{i}",
                question=row["question"],
                answer=gold,
                metadata={"solution": row["answer"], "source": source},
                columns={key: value for key, value in row.items() if key != "question"},
            )
        )
    return examples


def load_examples(
    dataset: str, split: str, num_examples: int, seed: int, *, difficulty: int = 1
) -> list[Example]:
    """Prompts for a run: "synthetic" generates `num_examples` problems from `seed` at `difficulty`
    (1 or 2); any other `dataset` is a GSM8K source for `load_gsm8k` (first `num_examples` rows,
    0 = all; no seed, and `difficulty` is ignored).
    """
    if dataset == "synthetic":
        if num_examples <= 0:
            raise ValueError(f"dataset 'synthetic' needs num_examples > 0, got {num_examples}")
        return arithmetic.make_examples(num_examples, seed, split, difficulty=difficulty)
    return load_gsm8k(dataset, split, limit=num_examples)
