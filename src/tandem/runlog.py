"""This process's log: the console format every command uses, and the run folder's train.log.

Light on purpose (no torch): `tandem` sets up logging before it knows whether it will load anything.
"""

from __future__ import annotations

import logging
from pathlib import Path

STEP_LOGGER = "tandem.steps"  # one line per optimizer step (trainer/metrics.py): train.log only

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_run_log: logging.Handler | None = None


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def attach_run_log(run_dir: Path) -> Path:
    """Also write this process's log to RUN/train.log (what the console shows, plus one line per
    step in place of the progress bar), appended across resumes. Rank 0 calls it once the run folder
    is settled; a second call (another run in the same process) moves the file."""
    global _run_log
    path = Path(run_dir) / "train.log"
    steps = logging.getLogger(STEP_LOGGER)
    if _run_log is not None:
        logging.getLogger().removeHandler(_run_log)
        steps.removeHandler(_run_log)
        _run_log.close()
    _run_log = logging.FileHandler(path, encoding="utf-8")
    _run_log.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(_run_log)
    steps.addHandler(_run_log)
    steps.setLevel(logging.INFO)
    steps.propagate = False
    return path
