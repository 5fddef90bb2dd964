"""The shards one producer holds: per shard a document stream, its batch generator, sequence number and
lease, and the order their batches are built in.

The trainer decides which shards a producer holds (consumer/assign.py) and where each starts (its cursor
after the last batch it accepted). A shard's stream depends only on (corpus, seed, shard, number of
shards, cursor), so a shard restarted here, or at another producer, makes the very same batches with the
very same sequence numbers: the trainer keeps the first copy of each and drops the others. Batches are
built for the least advanced shard first (see next_message).

In a mixture the trainer paces each shard with credits (messages.Credit, Welcome.credit): a shard's next
message (batch or end) is built only while its sequence number is within the shard's credit; a shard
without credit waits, and the others go on. Each shard also has its source's batch settings (its seed) and
epochs (the `plan` given to Holdings).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.stream import DocStream
from lmpipe.shared.batch import Batch, Cursor, end_frames


@dataclass
class HeldShard:
    shard: int
    stream: DocStream
    lease: str
    seq: int  # sequence number of the last message built
    gen: Generator[Batch, None, None] | None = None
    finished: bool = False  # its `end` is built: nothing more to send
    end_cursor: Cursor = field(default_factory=Cursor)
    docs_counted: int = 0  # documents of its stream already counted in the producer's metric
    credit: int | None = None  # the highest sequence number it may send (a mixture's); None: no limit
    spec: BatchSpec | None = None  # its source's batch settings (None: the producer's)
    epochs: int = 0  # its source's epochs (0: until stopped)

    def can_send(self) -> bool:
        return not self.finished and (self.credit is None or self.seq < self.credit)


Plan = Callable[[int, int], tuple[BatchSpec, int]]  # (shard, number of shards) -> its spec and epochs


class Holdings:
    def __init__(
        self,
        make_stream: Callable[[int, int], DocStream],
        spec: BatchSpec,
        epochs: int,
        dtype,
        plan: Plan | None = None,
    ):
        self._make_stream = make_stream  # (shard, number of shards) -> its DocStream
        self.spec, self.epochs, self.dtype = spec, epochs, dtype
        self._plan = plan or (lambda shard, total: (self.spec, self.epochs))
        self.shards: dict[int, HeldShard] = {}
        self.total = 0  # the run's number of shards, as the trainer said
        # The shards of the last assign: no batch is built while one of them still awaits its welcome, so
        # the order of batches does not depend on how the welcomes trickle in.
        self.assigned: set[int] = set()

    def __len__(self) -> int:
        return len(self.shards)

    def held(self) -> list[int]:
        return sorted(self.shards)

    def start(
        self, shard: int, total: int, lease: str, cursor: Cursor, next_seq: int, credit: int | None = None
    ) -> HeldShard:
        """(Re)start `shard` at `cursor`; its next message gets sequence number `next_seq`, and it may send
        up to sequence number `credit` (None: no limit)."""
        if total != self.total:  # another split (a new trainer session): no stream carries over
            assigned = self.assigned
            self.clear()
            self.assigned, self.total = assigned, total
        old = self.shards.get(shard)
        stream = old.stream if old is not None else self._make_stream(shard, total)
        if old is not None and old.gen is not None:
            old.gen.close()
        self.assigned.add(shard)
        stream.hold()
        spec, epochs = self._plan(shard, total)
        h = HeldShard(shard, stream, lease, next_seq - 1, credit=credit, spec=spec, epochs=epochs)
        h.docs_counted = stream.stats.documents
        h.gen = self._batches(h, cursor)
        self.shards[shard] = h
        return h

    def keep_only(self, shards: list[int]) -> list[int]:
        """Hold exactly `shards` (those not held yet come with their welcomes): give up every other one;
        returns the ones given up."""
        self.assigned = set(shards)
        gone = [s for s in self.shards if s not in shards]
        for s in gone:
            h = self.shards.pop(s)
            if h.gen is not None:
                h.gen.close()
            h.stream.release()
        return gone

    def clear(self) -> None:
        self.keep_only([])

    def grant(self, grants: dict[int, int]) -> None:
        """A credit: each held shard may send up to its sequence number (only ever raised here; a welcome
        sets it). Shards not held, and shards without a limit, are left alone."""
        for shard, upto in grants.items():
            h = self.shards.get(shard)
            if h is not None and h.credit is not None:
                h.credit = max(h.credit, upto)

    def next_message(self, session: str) -> tuple[HeldShard, list, Batch | None] | None:
        """The next message to send: (its shard, frames, the batch or None for an `end`), from the shard
        with data left that has sent the fewest (lowest seq; ties: lowest shard). That is round robin
        when the shards start together, keeps a moved-in shard from racing ahead of the others, and
        depends only on the cursors: a producer restarted from a checkpoint's cursors sends its batches
        in the order an uninterrupted one would have. None when nothing is left to send. An exception from
        the stream (the producer's keepalive, stopping it) leaves that shard's batches unusable: the producer
        exits. In a mixture, only shards with credit left are considered (None: none has any)."""
        live = [h for h in self.shards.values() if h.can_send()]
        if not live or not self.assigned <= self.shards.keys():
            return None
        h = min(live, key=lambda x: (x.seq, x.shard))
        assert h.gen is not None
        h.seq += 1
        try:
            batch = next(h.gen)
        except StopIteration:
            h.finished = True
            return h, end_frames(session, h.shard, h.seq, h.end_cursor, h.lease), None
        return h, batch.to_frames(session, h.shard, h.seq, h.lease), batch

    def _batches(self, h: HeldShard, cursor: Cursor) -> Generator[Batch, None, None]:
        h.end_cursor = Cursor(max(h.epochs, cursor.epoch))
        for b in batches(h.stream, h.spec or self.spec, cursor, h.epochs, dtype=self.dtype):
            h.end_cursor = b.cursor
            yield b
        h.stream.release()  # every epoch read: no later pass keeps its records
