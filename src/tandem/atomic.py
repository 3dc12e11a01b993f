"""Crash-safe writes: a file or folder appears under its final name only once it is complete and synced.

Write to a temporary name in the same folder, fsync, then rename (atomic on POSIX filesystems); a
crash leaves at most a `.tmp-*` leftover that no reader picks up. A temporary folder names its writer
(host, process id and the process's start time) in a `.writer` file, so a restarted run can tell the
leftovers of a killed save from a save in progress and remove only the former (`remove_leftovers`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

WRITER_FILE = ".writer"
# a leftover whose writer ran on another host cannot be checked; it is removed once it is this old
FOREIGN_LEFTOVER_SECONDS = 24 * 3600

log = logging.getLogger(__name__)


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
    """A fresh `.tmp-<name>-*` folder beside `final` (readers ignore such names), naming its writer."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    (tmp / WRITER_FILE).write_text(_writer_id(os.getpid()) or "")
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """fsync everything in tmp, then rename it to `final` in one step."""
    (tmp / WRITER_FILE).unlink(missing_ok=True)
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


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which a reused pid does not share."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def _writer_id(pid: int) -> str | None:
    started = _start_time(pid)
    return f"{socket.gethostname()} {pid} {started}" if started else None


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that made `tmp` may still be writing into it."""
    try:
        host, pid, started = (tmp / WRITER_FILE).read_text().split()
    except (OSError, ValueError):  # no marker: an interrupted start of the save, or an older tandem's
        return False
    if host != socket.gethostname():
        return time.time() - tmp.stat().st_mtime < FOREIGN_LEFTOVER_SECONDS
    return int(pid) != os.getpid() and _writer_id(int(pid)) == f"{host} {pid} {started}"


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the `.tmp-*` folders in `folder` that a killed writer left behind (never one whose
    writer is alive on this host, nor a recent one written from another host). Returns them."""
    removed = []
    if not folder.is_dir():
        return removed
    for tmp in sorted(folder.glob(".tmp-*")):
        if not tmp.is_dir() or _writer_alive(tmp):
            continue
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("removed %s (%.1f MB), left by an interrupted save", tmp, size / 2**20)
        removed.append(tmp)
    return removed
