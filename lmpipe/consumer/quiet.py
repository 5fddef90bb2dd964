"""Log lines about what peers send, kept bounded: a peer (buggy or hostile) controls how often they come
and what text they carry, and must not flood the trainer's log."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")


def printable(text: str, limit: int = 300) -> str:
    """A peer's text made safe for one log line: escapes for control characters, bounded length."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


class Quiet:
    """Logs a repeating message the first time, then at most once per `every` seconds with a count."""

    def __init__(self, every: float = 60.0):
        self.every = every
        self.seen: dict[str, tuple[float, int]] = {}

    def __call__(self, level: int, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self.seen.get(key, (-math.inf, 0))
        if now - last < self.every:
            self.seen[key] = (last, skipped + 1)
            return
        if len(self.seen) > 1000:  # many distinct keys (a fuzzer): forget, never grow without bound
            self.seen.clear()
        self.seen[key] = (now, 0)
        log.log(level, msg + (f" ({skipped} more like it since)" if skipped else ""), *args)


class Rejects:
    """Counts a dropped message by reason; logs the first five of each reason, then every 1000th."""

    def __init__(self, metrics: TrainerMetrics):
        self.metrics = metrics
        self.logged: dict[str, int] = {}

    def __call__(self, reason: str, detail: str) -> None:
        self.metrics.reject(reason)
        n = self.logged.get(reason, 0) + 1
        self.logged[reason] = n
        if n <= 5 or n % 1000 == 0:
            log.warning("dropped a message (%s, #%d): %s", reason, n, printable(detail))
