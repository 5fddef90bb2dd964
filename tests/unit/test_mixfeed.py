"""The mixture's feed (consumer/mixfeed.py) in-process, behind a stand-in for the receive thread whose
"producers" send each shard's batches in order, within the credit the feed grants, but interleaved at
random, with duplicates: the rows trained are the same whatever the arrival order, every batch is recorded
once in order by the ledger, and a receiver pool of exactly CREDIT_WINDOW slots per shard never deadlocks,
even for a 0.98/0.01/0.01 mixture."""

from __future__ import annotations

import queue
import random

import numpy as np
import torch

from lmpipe.consumer.datarecv import EndOfStream
from lmpipe.consumer.feed import DeviceFeed
from lmpipe.consumer.inputs import MaskCache
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.mixer import Mixer
from lmpipe.consumer.mixfeed import CREDIT_WINDOW, Assembly, MixFeed
from lmpipe.consumer.slots import HostSlot
from lmpipe.producer.batching import BatchSpec
from lmpipe.shared.batch import Batch
from lmpipe.shared.metrics import TrainerMetrics
from tests.mixtures import B, FixedMix, S, T, rows_of, shard_batches

SESSION = "s"


class Producers:
    """The receive thread's side: `ready.get()` delivers the next message of a random shard that has
    credit (and a free slot, for a batch); now and then a copy of one already sent."""

    def __init__(self, streams: dict[int, list[Batch]], table: Ledger, seed: int):
        self.streams, self.table, self.rng = streams, table, random.Random(seed)
        n = len(table)
        self.free = [HostSlot(B, T, np.dtype("<u2"), pin=False) for _ in range(n * CREDIT_WINDOW)]
        self.pool = len(self.free)
        self.sent = [0] * n  # last seq sent per shard
        self.upto = [CREDIT_WINDOW] * n  # the welcome's credit
        self.ready = self
        self.error = None
        self.credits = 0

    # the Receiver's interface, as the feed uses it
    def release(self, slot: HostSlot) -> None:
        slot.meta = None
        self.free.append(slot)

    def credit(self, shard: int) -> None:
        self.credits += 1
        self.upto[shard] = self.table[shard].last_seq + CREDIT_WINDOW

    def force_reset(self, shard: int, seq=None, arrived=None) -> None:
        self.sent[shard] = self.table[shard].last_seq  # a resend from the consumed cursor

    def wait_line(self, now: float) -> str:
        return ""

    def qsize(self) -> int:
        return 0

    def get(self, timeout: float = 0.0):
        n = len(self.streams)
        if self.free and self.rng.random() < 0.1:  # a duplicate: a new holder repeating a consumed batch
            shard = self.rng.randrange(n)
            if self.table[shard].last_seq > 0:
                return self._batch(shard, self.rng.randint(1, self.table[shard].last_seq))
        can = [
            s for s in range(n)
            if self.sent[s] < self.upto[s] and self.sent[s] <= len(self.streams[s])
            and (self.free or self.sent[s] == len(self.streams[s]))
        ]  # fmt: skip
        if not can:
            raise queue.Empty
        shard = self.rng.choice(can)
        self.sent[shard] += 1
        seq = self.sent[shard]
        if seq > len(self.streams[shard]):
            return EndOfStream(shard, seq, self.streams[shard][-1].cursor, SESSION)
        return self._batch(shard, seq)

    def _batch(self, shard: int, seq: int) -> HostSlot:
        slot = self.free.pop()
        slot.fill(self.streams[shard][seq - 1], shard, seq, SESSION, 0.0)
        return slot


def mixed_rows(weights, streams, seed: int, steps: int) -> tuple[list, MixFeed, Producers]:
    table = Ledger(len(streams), SESSION)
    prod = Producers(streams, table, seed)
    metrics = TrainerMetrics()
    assembly_slots = [HostSlot(B, T, np.dtype("<u2"), pin=False) for _ in range(2)]
    assembly = Assembly(prod, assembly_slots)  # type: ignore[arg-type]
    feed = DeviceFeed(assembly, table, metrics, torch.device("cpu"), copy_stream=False, rows=None,  # type: ignore[arg-type]
                      attention="auto", mask_cache=MaskCache(), wait_timeout=2.0)  # fmt: skip
    mixer = Mixer(FixedMix(weights), S, B, T)
    mf = MixFeed(feed, assembly, mixer, table, metrics)
    rows = []
    for _ in range(steps):
        slots, _, problem = mf.take(1, stopping=lambda: False)
        assert problem is None, problem
        if not slots:
            break
        rows += rows_of(slots[0])
        feed.copy(slots[0])  # on CPU: converted, and the slot goes back to its pool
    return rows, mf, prod


def streams_of(sources: int, sizes=(300, 300, 300)) -> dict[int, list[Batch]]:
    spec = BatchSpec(strategy="pack", seq_len=T, batch_size=B)
    return {s: shard_batches(s, sizes[s // S], spec) for s in range(sources * S)}


def test_the_same_rows_whatever_order_batches_arrive_in() -> None:
    streams = streams_of(3)
    first, mf, prod = mixed_rows((0.5, 0.3, 0.2), streams, seed=1, steps=30)
    second, _, _ = mixed_rows((0.5, 0.3, 0.2), streams, seed=2, steps=30)
    assert len(first) == 30 * B and first == second
    assert prod.credits > 0 and mf.metrics.stale_count > 0  # credits granted; duplicates dropped
    for w in mf.table.shards:  # every consumed batch recorded, in order
        assert all(s.meta is None or s.meta.seq > w.last_seq for s in mf.stash[w.shard])


def test_a_lopsided_mixture_does_not_deadlock_with_the_pool_it_is_given() -> None:
    streams = streams_of(3, sizes=(1500, 60, 60))
    rows, mf, prod = mixed_rows((0.98, 0.01, 0.01), streams, seed=3, steps=60)
    assert len(rows) == 60 * B
    shares = mf.mixer.shares()
    assert shares["web"]["share"] > 0.95 and shares["code"]["tokens"] > 0


def test_a_source_that_runs_out_stops_the_feed_with_its_name() -> None:
    streams = streams_of(2, sizes=(200, 4))
    rows, mf, _ = mixed_rows((0.5, 0.5), streams, seed=4, steps=200)
    assert mf.mixer.exhausted == "code" and len(rows) < 200 * B
    assert all(mf.table[s].finished for s in range(S, 2 * S))
