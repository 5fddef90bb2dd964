"""The exactly-once ledger: what the trainer consumed of each shard, and the one verdict on a batch.

A batch is identified by (session, shard, seq) and carries the cursor after it; a shard's stream is
deterministic, so its batches must be trained in seq order, each once. `classify` is the only place that
says whether a batch is the next one of its shard or why not:

- `old_session`: sent for another trainer session (a restarted trainer's producers still draining);
- `not_holder`: without the current holder's lease (another peer's, or a previous holder's in flight);
- `duplicate`: at or before the last consumed seq (a resend, or a new holder repeating what was trained);
- `gap`: past the next one (a batch went missing; its producer is asked to resend);
- `next`: the one to train on.

The receive thread asks early (to drop what can never be used without a host slot); the step loop asks
again when it consumes, under the lock, through `accept`, which also records the consumption. Holder
fields (identity, lease, last_seen) are written by the coordinator (consumer/coordinator.py); the
consumption fields only by `accept` and `load_state_dict`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from lmpipe.shared.batch import Cursor
from lmpipe.shared.messages import ALIVE_SECONDS

NEXT = "next"
# the other verdicts are the reasons of lmpipe_trainer_stale_batches_total
OLD_SESSION, NOT_HOLDER, DUPLICATE, GAP = "old_session", "not_holder", "duplicate", "gap"


@dataclass
class ShardState:
    """One shard: what the trainer consumed of it, and who serves it now."""

    shard: int
    cursor: Cursor = field(default_factory=Cursor)  # after the last consumed batch
    last_seq: int = 0  # last consumed sequence number
    finished: bool = False
    identity: bytes | None = None  # its holder's routing id (None: no producer serves it now)
    last_seen: float = 0.0  # its holder's last hello
    where: str = ""  # its holder, for logs
    failed: str = ""  # why this shard was stopped for good (a deterministic failure)
    lease: str = ""  # the current holder's token (messages.Welcome.lease); new for every new holder

    def alive(self, now: float) -> bool:
        """A producer holds it and was heard from lately."""
        return self.identity is not None and now - self.last_seen < ALIVE_SECONDS

    def open(self) -> bool:
        """Still to be served: neither finished nor stopped for good."""
        return not (self.finished or self.failed)


def cursor_list(state: list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """The per-shard cursors of a pipeline's state: the list itself, or a mixture's {"shards": ...}."""
    if isinstance(state, dict):
        if not isinstance(state.get("shards"), list) or not isinstance(state.get("mix"), dict):
            raise ValueError("a mixture's state holds its shards' cursors and the mixer's state")
        return state["shards"]
    return state


class Ledger:
    """Every shard's consumption state in one session, shared by the receive thread and the step loop."""

    def __init__(self, n: int, session: str, first: int | None = None, space: int | None = None):
        """`first`, `space`: each source's shard j here is its global shard first + j of `space`, as the
        welcome tells producers (consumer/reshard.py); None: the producers' own --rank of --world-size."""
        self.lock = threading.Lock()
        self.session = session
        self.shards = [ShardState(i) for i in range(n)]
        self.first, self.space = first, space

    def __getitem__(self, i: int) -> ShardState:
        return self.shards[i]

    def __len__(self) -> int:
        return len(self.shards)

    def classify(self, shard: int, session: str, seq: int, lease: str | None = None) -> str:
        """The verdict on a batch (or end) of shard `shard` (in range): NEXT, or why it is not the next
        one to train on. `lease`: the batch's lease, checked against the current holder's; None: not
        checked (the step loop: the receive thread checked it when the batch arrived)."""
        if session != self.session:
            return OLD_SESSION
        w = self.shards[shard]
        if lease is not None and lease != w.lease:
            return NOT_HOLDER
        last = w.last_seq
        return DUPLICATE if seq <= last else GAP if seq > last + 1 else NEXT

    def accept(self, shard: int, session: str, seq: int, cursor: Cursor, end: bool = False) -> str:
        """Classify and, when it is the next, record it consumed (an `end` also finishes its shard)."""
        with self.lock:
            why = self.classify(shard, session, seq)
            if why == NEXT:
                w = self.shards[shard]
                w.last_seq, w.cursor = seq, cursor
                w.finished = w.finished or end
            return why

    def all_finished(self) -> bool:
        return all(w.finished for w in self.shards)

    def missing(self, now: float) -> list[int]:
        """Shards with no live producer that still have data to send."""
        return [w.shard for w in self.shards if not (w.alive(now) or w.finished or w.failed)]

    def state_dict(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"cursor": w.cursor.to_dict(), "last_seq": w.last_seq, "finished": w.finished}
                for w in self.shards
            ]

    def load_state_dict(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        state = cursor_list(state)
        if len(state) != len(self.shards):
            raise ValueError(
                f"checkpoint has {len(state)} shard cursors, this run has {len(self.shards)} shards"
            )
        with self.lock:
            for w, s in zip(self.shards, state):
                w.cursor, w.last_seq, w.finished = (
                    Cursor.from_dict(s["cursor"]),
                    int(s["last_seq"]),
                    bool(s["finished"]),
                )
