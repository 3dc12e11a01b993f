"""Counting what a channel drops, and saying so without letting a flood of bad messages flood the log."""

from __future__ import annotations

import logging
import time
from collections import Counter

WARN_INTERVAL_S = 5.0  # at most one warning per drop reason in this many seconds


class Drops:
    """`counts[reason]` of dropped messages; `add` logs one warning per reason every WARN_INTERVAL_S
    (each with the count so far), whatever the rate of drops."""

    def __init__(self, logger: logging.Logger, where: str) -> None:
        self.counts: Counter[str] = Counter()
        self._logger, self.where = logger, where
        self._last: dict[str, float] = {}

    def add(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._last.get(reason, float("-inf")) >= WARN_INTERVAL_S:
            self._last[reason] = now
            self._logger.warning(
                "dropped a message on %s (%s, %d so far): %s",
                self.where,
                reason,
                self.counts[reason],
                message,
            )
