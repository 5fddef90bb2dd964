"""One read of a streamed corpus per producer, shared by the shards it holds.

Shard s of n owns the records whose id % n == s. A producer holding 16 shards of a text, JSONL or table
corpus would otherwise read (decompress, decode, split) the whole corpus 16 times an epoch, each time to
keep a 16th of it: measured, a fifth of a producer's time on WikiText-2. Here a *pass* reads the corpus
once and deals each record to a queue per shard. Every shard this producer holds is enrolled in a pass
when the pass starts, so a shard that begins reading later (its first batch, its next epoch, a restart
at a cursor) takes its records from its queue; the first shard to start its next epoch starts the next
pass, and the others are enrolled in it for when they get there, even while they are still an epoch or
more behind (a shard reads the oldest pass it is enrolled in) - but in at most PENDING_PASSES passes it has
not begun: a shard that finishes an epoch every batch (it owns a few small records) would otherwise enroll
a shard stuck on huge documents in a new pass each epoch, and every pass would keep that shard's records
until it got there. One further behind starts a new pass when it gets there: a read more, no memory more.

A shard reads exactly what `Corpus.records(shard, n)` gives it, in the same order, so documents, cursors
and batches do not change. Queues are bounded: when the passes hold more than `budget` bytes in all (a
shard far behind the others, huge documents), the shard with the longest queue leaves its pass and reads
the rest of its records on its own, as before. A lagging shard costs reads, never unbounded memory: at
most `budget` bytes, in at most PENDING_PASSES + 1 passes a shard.
Random-access corpora (shards from `lmpipe prepare`, the built-in corpus) read by index and need none
of this.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

from lmpipe.producer.sources import Corpus, Record

SCAN_BUDGET_BYTES = 256 << 20  # records read ahead for the shards this producer holds, at most
PENDING_PASSES = 2  # passes a shard is enrolled in before it begins reading them, at most


def record_bytes(rec: Record) -> int:
    """About what a queued record holds (the text's characters, 8 bytes an id, the object itself)."""
    n = 200 + len(rec.text or "") + len(rec.prompt or "")
    return n + (8 * len(rec.ids) if rec.ids is not None else 0)


class _Pass:
    """One read of the corpus, dealt to its members' queues."""

    def __init__(self, records: Iterator[Record]):
        self.records = records
        self.queues: dict[int, deque[Record]] = {}  # member shard -> records read, not yet taken
        self.readers: dict[int, object] = {}  # member shard -> the read taking its records
        self.done = False


class SharedScan:
    def __init__(self, corpus: Corpus, total: int, budget: int = SCAN_BUDGET_BYTES):
        self.corpus, self.total, self.budget = corpus, total, budget
        self.held: set[int] = set()  # shards enrolled in every new pass
        self.passes: list[_Pass] = []
        self.bytes = 0  # queued in all passes, by record_bytes

    def hold(self, shard: int) -> None:
        self.held.add(shard)

    def release(self, shard: int) -> None:
        """This producer no longer reads `shard`: drop its queues."""
        self.held.discard(shard)
        for p in list(self.passes):
            self._leave(p, shard)

    def records(self, shard: int) -> Iterator[Record]:
        """The records `shard` owns, in corpus order: Corpus.records(shard, total), read once for all."""
        token = object()  # this read: a shard restarted mid-pass replaces its old read, never shares it
        for p in list(self.passes):  # at most one read per shard
            if shard in p.readers:
                self._leave(p, shard)
        p = self._pass_for(shard)
        p.readers[shard] = token
        last = -1
        try:
            while True:
                q = p.queues.get(shard)
                if q is None:  # left the pass (over budget): the rest alone, as Corpus.records gives it
                    for rec in self.corpus.records(shard, self.total):
                        if rec.rid > last:
                            yield rec
                    return
                if q:
                    rec = q.popleft()
                    self.bytes -= record_bytes(rec)
                    last = rec.rid
                    yield rec
                elif p.done:
                    return
                else:
                    self._read_one(p)
        finally:
            if p.readers.get(shard) is token:
                self._leave(p, shard)

    def _pass_for(self, shard: int) -> _Pass:
        for p in self.passes:  # enrolled when it started, not read yet: its queue holds every record so far
            if shard in p.queues and shard not in p.readers:
                return p
        # every held shard, also one still behind in an older pass: it reads this one when it gets here;
        # unless PENDING_PASSES already wait for it (`shard` itself waits for none: it found none above)
        waiting = Counter(s for o in self.passes for s in o.queues if s not in o.readers)
        p = _Pass(self.corpus.records(0, 1))
        for s in self.held | {shard}:
            if waiting[s] < PENDING_PASSES:
                p.queues[s] = deque()
        self.passes.append(p)
        return p

    def _read_one(self, p: _Pass) -> None:
        rec = next(p.records, None)
        if rec is None:
            p.done = True
            return
        q = p.queues.get(rec.rid % self.total)
        if q is None:  # not held here: another producer's
            return
        q.append(rec)
        self.bytes += record_bytes(rec)
        # over budget: the longest queue of any pass goes (most likely the shard furthest behind)
        while self.bytes > self.budget:
            longest = max(
                ((o, s) for o in self.passes for s in o.queues), key=lambda os: len(os[0].queues[os[1]])
            )
            self._drop_queue(*longest)

    def _drop_queue(self, p: _Pass, shard: int) -> None:
        q = p.queues.pop(shard, None)
        if q:
            self.bytes -= sum(record_bytes(r) for r in q)
        if not p.queues:
            self.passes.remove(p)
            close = getattr(p.records, "close", None)
            if close is not None:
                close()

    def _leave(self, p: _Pass, shard: int) -> None:
        p.readers.pop(shard, None)
        if p in self.passes:
            self._drop_queue(p, shard)
