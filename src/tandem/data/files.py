"""Data-set rows from .jsonl and .parquet files or a hub data set, each labelled with where it came
from (`file:line`, `file:row i`), so a bad row's error names its place. GSM8K, SFT and preference
loading all read through these.
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


def read_rows(path: Path) -> Rows:
    """A .parquet file by read_parquet, anything else as JSON lines."""
    return read_parquet(path) if path.suffix == ".parquet" else read_jsonl(path)


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
