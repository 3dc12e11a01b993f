"""Crash-safe writes: a file or folder appears under its final name only once it is complete and synced.

Write to a temporary name in the same folder, fsync, then rename (atomic on POSIX filesystems); a
crash leaves at most a `.tmp-*` leftover that no reader picks up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def atomic_dir(final: Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_dir), fsync everything, then rename tmp_dir to `final` in one step."""
    tmp = temporary_dir(final)
    try:
        write(tmp)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def temporary_dir(final: Path) -> Path:
    """A fresh `.tmp-<name>-*` folder beside `final` (readers ignore such names)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))


def commit_dir(tmp: Path, final: Path) -> None:
    """fsync everything in tmp, then rename it to `final` in one step."""
    fsync_tree(tmp)
    if final.exists():  # re-saving the same name (e.g. a step after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def atomic_write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    """Replace `path` with `text` in one step; readers see the old or the new content, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
