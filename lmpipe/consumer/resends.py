"""Resend requests: how the trainer gets a shard's stream going again after a gap or a rejected batch.

A batch of this session that is missing (a gap) or rejected makes the trainer ask the shard's holder to
resend from the last consumed batch (a forced welcome): at most one request outstanding per shard, at most
MAX_RESENDS at one position. A batch rejected again after a resend, or a position that never arrives
intact, is a deterministic failure: the shard is stopped (`fail`, consumer/coordinator.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmpipe.consumer.ledger import Ledger
from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")

RESEND_TIMEOUT = 5.0  # a resend request not answered within this long may be repeated
MAX_RESENDS = 3  # resend requests at one position, without progress, before the shard is stopped


@dataclass
class ResendState:
    """One shard's outstanding request (receive thread only)."""

    at: int = -1  # last_seq when the last resend request went out
    sent: float = 0.0
    count: int = 0  # requests at `at` so far
    answered_at: float = 0.0  # when seq at + 1 arrived (accepted or not) after the request
    due: str = ""  # why another request is wanted once the outstanding one times out
    rejected: dict[int, str] = field(default_factory=dict)  # seq -> why the receiver rejected it


class Resends:
    def __init__(
        self,
        ledger: Ledger,
        metrics: TrainerMetrics,
        welcome: Callable[[int], None],
        fail: Callable[[int, str], None],
    ):
        self.ledger, self.metrics = ledger, metrics
        self._welcome = welcome  # a forced welcome of a shard to its holder
        self._fail = fail  # stop a shard for good, with the reason
        self.state = [ResendState() for _ in range(len(ledger))]
        self.loop: asyncio.AbstractEventLoop | None = None  # the receive thread's, once it runs

    def arrived(self, shard: int, seq: int, now: float) -> None:
        """A batch of `shard`'s current holder arrived, accepted or not."""
        r = self.state[shard]
        if r.sent and not r.answered_at and seq == r.at + 1:
            r.answered_at = now

    def rejected(self, shard: int, seq: int, why: str) -> None:
        """The current holder's batch `seq` was rejected: ask again, or stop the shard if it was already."""
        w, r = self.ledger[shard], self.state[shard]
        if seq <= w.last_seq or w.failed:
            return
        if seq in r.rejected:
            self._fail(shard, f"its batch seq {seq} is rejected every time it is sent ({why})")
            return
        for s in [s for s in r.rejected if s <= w.last_seq]:
            del r.rejected[s]
        if len(r.rejected) < 256:
            r.rejected[seq] = why
        self.request(shard, f"batch seq {seq} was rejected ({why})")

    def request(self, shard: int, why: str, arrived: float | None = None) -> None:
        """Ask `shard`'s holder to resend from the consumed cursor, within the limits above; `arrived`:
        when the message that showed the problem arrived (one sent before the last rewind is ignored)."""
        w, r = self.ledger[shard], self.state[shard]
        now = time.monotonic()
        if w.failed or w.finished or not w.alive(now):
            return  # nothing more is wanted, or a producer that (re)joins is sent to the cursor anyway
        with self.ledger.lock:
            last = w.last_seq
        if r.at != last:  # progress since the last request: start counting afresh
            r.at, r.count, r.sent, r.answered_at, r.due = last, 0, 0.0, 0.0, ""
        elif arrived is not None and arrived < max(r.sent, r.answered_at):
            return  # sent before the producer rewound; the resent stream is on its way
        elif not r.answered_at and now - r.sent < RESEND_TIMEOUT:
            if not r.due:  # look again when the outstanding request times out
                assert self.loop is not None
                self.loop.call_later(r.sent + RESEND_TIMEOUT - now, self._timeout, shard)
            r.due = why
            return
        if r.count >= MAX_RESENDS:
            self._fail(
                shard,
                f"batch seq {last + 1} never arrived intact after {MAX_RESENDS} resend requests ({why})",
            )
            return
        r.count += 1
        r.sent, r.answered_at, r.due = now, 0.0, ""
        self.metrics.stream_resets.labels(str(shard)).inc()
        log.warning(
            "shard %d %s, expected %d: asking it to resend (%d/%d)",
            shard,
            why,
            last + 1,
            r.count,
            MAX_RESENDS,
        )
        self._welcome(shard)

    def _timeout(self, shard: int) -> None:
        r = self.state[shard]
        why, r.due = r.due, ""
        if why:
            self.request(shard, why)
