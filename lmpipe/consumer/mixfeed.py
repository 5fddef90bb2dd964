"""The device feed of a mixture: received batches stashed per shard, handed to the mixer when it asks.

In a mixture the order of training is the mixer's (consumer/mixer.py), not the order batches arrive in.
The receive thread fills slots as today; the step loop files each ready slot (or `end`) under its shard,
in seq order, until the mixer asks for that shard's next batch. A batch is recorded consumed by the ledger
when its last row is taken; then its slot goes back to the receiver and the shard's credit is raised: its
holder may send up to CREDIT_WINDOW messages past the last consumed one (the batch being sliced and one
more). The assembled batches are pinned slots of their own and go through the feed's copy, to_device and
batch as a received slot does.

No deadlock, by construction: the receiver's pool has CREDIT_WINDOW slots per shard; a shard's stash holds
at most CREDIT_WINDOW of its batches (its credit; anything past it is dropped as a gap and asked for
again), and the shard whose batch the mixer waits for holds none of its own, so a free slot is always
there for that batch. The assembled ones are apart: the pool the trainer sizes (its --slots). Duplicates
and gaps take a receiver slot only until the step loop, which drains the ready queue while it waits,
drops them.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lmpipe.consumer import ledger as verdicts
from lmpipe.consumer.datarecv import EndOfStream
from lmpipe.consumer.feed import HEALTH_EVERY, DeviceFeed
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.mixer import END, STOP, Mixer
from lmpipe.consumer.receiver import Receiver
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")
CREDIT_WINDOW = 2  # messages a shard's holder may send past the last consumed: the one sliced, one more


class Assembly:
    """The receiver as the device feed sees it, with the assembly slots returned to their own pool."""

    def __init__(self, receiver: Receiver, slots: list[HostSlot]):
        self._receiver = receiver
        self._mine = {id(s) for s in slots}
        self.free = list(slots)

    def release(self, slot: HostSlot) -> None:
        if id(slot) in self._mine:
            slot.meta = None
            self.free.append(slot)
        else:
            self._receiver.release(slot)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._receiver, name)


class MixFeed:
    def __init__(
        self, feed: DeviceFeed, assembly: Assembly, mixer: Mixer, table: Ledger, metrics: TrainerMetrics
    ):
        self.feed, self.assembly, self.mixer, self.table, self.metrics = feed, assembly, mixer, table, metrics
        self.receiver: Receiver = feed.receiver
        n = len(table)
        self.stash: list[deque[HostSlot | EndOfStream]] = [deque() for _ in range(n)]
        self.top = [w.last_seq for w in table.shards]  # per shard: the highest seq filed (or consumed)
        mixer.ended = [w.finished for w in table.shards]
        mixer.set_epochs([w.cursor.epoch for w in table.shards])
        self._published = [s.trained for s in mixer.sources]
        self._waited = 0.0
        self._problem: str | None = None
        self._stopping: Callable[[], bool] = lambda: False
        self._last_news = time.monotonic()
        self._said_exhausted = False
        self.publish()

    # -- the step loop's side ------------------------------------------------------------------------

    def take(self, n: int, stopping: Callable[[], bool]) -> tuple[list[HostSlot], float, str | None]:
        """Up to n assembled batches (one optimizer step's), the seconds waited, a reason to stop."""
        self._waited, self._problem, self._stopping = 0.0, None, stopping
        got: list[HostSlot] = []
        while len(got) < n and not self.mixer.exhausted and not stopping() and self._problem is None:
            out = self._assembly_slot()
            if out is None:
                break
            rows = self.mixer.assemble(out, self._fetch, self._consumed, self.table.session)
            if rows:
                got.append(out)
            else:
                self.assembly.release(out)
                break
        if got:
            self.mixer.step += 1  # a take() is one optimizer step (the Loader's: one batch)
        self.publish()
        if self.mixer.exhausted and not self._said_exhausted:
            self._said_exhausted = True
            name = self.mixer.exhausted
            log.info(
                "source %s has no more data (every shard of it finished its epochs): the run stops", name
            )
        return got, self._waited, self._problem

    def _assembly_slot(self) -> HostSlot | None:
        while not self.assembly.free:  # on CUDA a slot comes back once its copy is done
            t0 = time.perf_counter()
            self.feed.release_done()
            if self.assembly.free or self._stopping():
                break
            time.sleep(0.0005)
            self._waited += time.perf_counter() - t0
        return self.assembly.free.pop() if self.assembly.free else None

    def _fetch(self, shard: int) -> HostSlot | str:
        """Shard's next batch (or END), waiting for it as DeviceFeed.take waits; STOP to stop."""
        stash = self.stash[shard]
        while not stash:
            if self._problem is not None or self._stopping() or not self._pump():
                return STOP
        item = stash.popleft()
        if isinstance(item, EndOfStream):
            if self.table.accept(shard, item.session, item.seq, item.cursor, end=True) == verdicts.NEXT:
                log.debug("shard %d finished its data", shard)
            return END
        return item

    def _consumed(self, shard: int, slot: HostSlot) -> None:
        m = slot.meta
        assert m is not None
        why = self.table.accept(shard, m.session, m.seq, m.cursor)
        assert why == verdicts.NEXT, f"shard {shard} seq {m.seq}: {why}"  # filed in order: always the next
        self.assembly.release(slot)
        self.receiver.credit(shard)

    def _pump(self) -> bool:
        """File one ready item, or wait a little for one; False when the run must stop."""
        feed, now = self.feed, time.monotonic()
        if feed.health_check and now - feed._health_at >= HEALTH_EVERY:
            feed._health_at = now
            if problem := feed.health_check():
                self._problem = problem
                return False
        t0 = time.perf_counter()
        try:
            item = self.receiver.ready.get(timeout=0.01)
        except queue.Empty:
            self._waited += time.perf_counter() - t0
            feed.release_done()
            feed.check_receiver()
            now = time.monotonic()
            if now - self._last_news > 10:
                log.info("waiting for batches: %s", self.receiver.wait_line(now))
                self._last_news = now
            if feed.wait_timeout and self._waited > feed.wait_timeout:
                self._problem = f"no data for {self._waited:.0f} s (--wait-timeout {feed.wait_timeout:g})"
                return False
            return True
        self._waited += time.perf_counter() - t0
        self._last_news = time.monotonic()
        self.metrics.ready_slots.set(self.receiver.ready.qsize())
        self._file(item)
        return True

    def _file(self, item: HostSlot | EndOfStream) -> None:
        """Under its shard, if it is the shard's next message within its credit; dropped otherwise."""
        if isinstance(item, EndOfStream):
            shard, seq, session, arrived = item.shard, item.seq, item.session, item.received_at
        else:
            assert item.meta is not None
            m = item.meta
            shard, seq, session, arrived = m.shard, m.seq, m.session, m.received_at
        w = self.table[shard]
        expected = max(self.top[shard], w.last_seq) + 1
        over = not isinstance(item, EndOfStream) and seq > w.last_seq + CREDIT_WINDOW
        why = (
            verdicts.OLD_SESSION
            if session != self.table.session
            else verdicts.DUPLICATE
            if seq < expected
            else verdicts.GAP
            if seq > expected or over
            else verdicts.NEXT
        )
        if why == verdicts.NEXT:
            self.top[shard] = seq
            self.stash[shard].append(item)
            return
        self.metrics.drop_stale(why)
        if why == verdicts.GAP:
            self.receiver.force_reset(shard, seq, arrived)
        if not isinstance(item, EndOfStream):
            self.assembly.release(item)

    # -- metrics -------------------------------------------------------------------------------------

    def publish(self) -> None:
        """Per source: tokens trained, realized and target share, epoch."""
        m, shares = self.metrics, self.mixer.shares()
        for k, (name, s) in enumerate(shares.items()):
            trained = self.mixer.sources[k].trained
            if trained > self._published[k]:
                m.source_tokens.labels(name).inc(trained - self._published[k])
                self._published[k] = trained
            m.source_share.labels(name).set(s["share"])
            m.source_target_share.labels(name).set(s["target"])
            m.source_epoch.labels(name).set(s["epoch"])
