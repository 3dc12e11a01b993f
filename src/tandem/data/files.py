"""Data-set rows from .jsonl, .json, .csv and .parquet files, folders saved by `datasets`, or a hub data
set, each labelled with where it came from (`file:line`, `file:row i`), so a bad row's error names its
place. Prompt, SFT and preference loading all read through these.
"""

from __future__ import annotations

import json
from pathlib import Path

Rows = list[tuple[str, dict]]  # (where, row)


def read_jsonl(path: Path) -> Rows:
    """One JSON object per non-blank line, labelled `file:line`."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
            rows.append((f"{path}:{line_no}", row))
    return rows


def read_parquet(path: Path) -> Rows:
    """The table's rows as dicts, labelled `file:row i` (pyarrow, else pandas)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        try:
            import pandas as pd
        except ImportError as err:
            raise ValueError(
                f"reading {path} needs pyarrow: pip install pyarrow (or use a .jsonl file)"
            ) from err
        records = pd.read_parquet(path).to_dict("records")
    else:
        records = pq.read_table(path).to_pylist()
    return [(f"{path}:row {i}", row) for i, row in enumerate(records)]


def read_json(path: Path) -> Rows:
    """A .json file holding an array of objects (`file:row i`), or JSON lines under a .json name."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return read_jsonl(path)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from err
    return [(f"{path}:row {i}", row) for i, row in enumerate(records)]


def read_csv(path: Path) -> Rows:
    """A .csv (or tab-separated .tsv) file with a header row; values stay strings, labelled
    `file:line` (the header is line 1)."""
    import csv

    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        rows = []
        for row in reader:
            if None in row:  # more fields than the header names
                raise ValueError(f"{path}:{reader.line_num}: more values than the header's columns")
            rows.append((f"{path}:{reader.line_num}", dict(row)))
    return rows


def read_rows(path: Path) -> Rows:
    """A file by its suffix: .parquet, .json, .csv/.tsv; anything else as JSON lines."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return read_parquet(path)
    if suffix == ".json":
        return read_json(path)
    if suffix in (".csv", ".tsv"):
        return read_csv(path)
    return read_jsonl(path)


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (one split, or a DatasetDict of splits)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def read_saved_dataset(path: Path, split: str) -> Rows:
    """Rows of a folder saved by `datasets` (`Dataset.save_to_disk`; a DatasetDict gives `split`),
    labelled `folder[split] row i`."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"{path} was saved by `datasets`; reading it needs that package: pip install datasets"
        ) from err
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path} holds the splits {sorted(loaded)}, not {split!r}; set data.split")
        loaded = loaded[split]
    return [(f"{path}[{split}] row {i}", row) for i, row in enumerate(loaded)]


def read_hub(
    name: str, split: str, *, subset: str | None = None, instead: str = "a local .jsonl/.parquet file"
) -> Rows:
    """A hub data set's split (needs `datasets` and a network), labelled `name[split] row i`;
    `instead` says what to pass when it cannot be loaded."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"loading {name!r} from the hub needs the `datasets` package: pip install 'tandem[hub]' "
            f"(or pip install datasets); or pass {instead}"
        ) from err
    try:
        rows = datasets.load_dataset(name, subset, split=split)
    except Exception as err:  # offline, unknown split, hub error: all fixed the same way
        raise ValueError(
            f"could not load {name!r} split {split!r} from the hub ({type(err).__name__}: {err}); "
            f"pass {instead} instead"
        ) from err
    return [(f"{name}[{split}] row {i}", row) for i, row in enumerate(rows)]
