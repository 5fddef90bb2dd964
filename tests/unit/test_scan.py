"""The shared scan (producer/scan.py): the shards one producer holds read a streamed corpus once per pass,
and each still gets exactly the batches a read of its own gives it, whatever order the shards are
served in, however far apart their epochs are, when they restart at a cursor or leave over budget."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.held import Holdings
from lmpipe.producer.scan import PENDING_PASSES, SharedScan, record_bytes
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.batch import Cursor

SHARDS = 7
EPOCHS = 3


@pytest.fixture
def corpus_files(tmp_path):
    """Short and long documents, one line or many, and records every reader must skip (bad UTF-8, blank)."""
    rng = random.Random(5)
    text = tmp_path / "a.txt"
    blocks = []
    for _ in range(260):
        lines = [" ".join(f"w{rng.randrange(400)}" for _ in range(rng.choice([1, 3, 40, 200])))]
        lines *= rng.choice([1, 1, 2, 5])
        blocks.append("\n".join(lines))
    text.write_bytes(
        "\n\n".join(blocks[:130]).encode() + b"\n\n\xff\xfe broken\n\n" + "\n\n".join(blocks[130:]).encode()
    )
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(f'{{"text": "doc {i} " }}\n' if i % 9 else "not json\n" for i in range(90)))
    return [str(text), str(jsonl)]


class CountingCorpus(Corpus):
    """Counts reads of the corpus from its start (one per call of records())."""

    reads = 0

    def records(self, worker=0, num_workers=1):
        self.reads += 1
        return super().records(worker, num_workers)


def run(files, tok, *, shared: bool, order_seed: int, budget: int = 1 << 30, restarts: int = 0):
    """Every batch of every shard (shard -> list of token arrays) over EPOCHS, with the shards served
    in a random order, some restarted at the cursor of their last batch; and the corpus reads made."""
    corpus = CountingCorpus(files, doc_split="blank")
    scan = SharedScan(corpus, SHARDS, budget=budget) if shared else None
    spec = BatchSpec(strategy="pack", seq_len=32, batch_size=2)
    holdings = Holdings(
        lambda s, n: DocStream(corpus, tok, s, n, shuffle_window=8, encode_batch=5, scan=scan),
        spec, EPOCHS, np.int32,
    )  # fmt: skip
    for s in range(SHARDS):
        holdings.start(s, SHARDS, "lease", Cursor(), 1)
    rng = random.Random(order_seed)
    got: dict[int, list[np.ndarray]] = {s: [] for s in range(SHARDS)}
    live = set(range(SHARDS))
    while live:
        s = rng.choice(sorted(live))  # any shard may run ahead: epochs drift apart
        h = holdings.shards[s]
        assert h.gen is not None
        b = next(h.gen, None)
        if b is None:
            live.discard(s)
            continue
        got[s].append(b.tokens.copy())
        if restarts and rng.random() < 0.02:  # a restart at the cursor after the last batch taken
            restarts -= 1
            holdings.start(s, SHARDS, "lease", b.cursor, 1)
    return got, corpus.reads


def same(a: dict, b: dict) -> bool:
    return all(len(a[s]) == len(b[s]) and all(np.array_equal(x, y) for x, y in zip(a[s], b[s])) for s in a)


@pytest.mark.parametrize("order_seed", [0, 1])
def test_shared_scan_gives_each_shard_its_own_batches_and_reads_the_corpus_once_a_pass(
    corpus_files, tok, order_seed
):
    alone, alone_reads = run(corpus_files, tok, shared=False, order_seed=order_seed)
    shared, shared_reads = run(corpus_files, tok, shared=True, order_seed=order_seed)
    assert sum(len(v) for v in alone.values()) > 10 * SHARDS
    assert same(alone, shared)
    assert alone_reads == SHARDS * EPOCHS
    # a random serving order lets epochs drift apart: a shard an epoch behind is enrolled in the newer
    # pass as well, so there is still one read of the corpus per epoch
    assert shared_reads == EPOCHS, shared_reads


def test_round_robin_reads_the_corpus_once_an_epoch(corpus_files, tok):
    corpus = CountingCorpus(corpus_files)
    scan = SharedScan(corpus, SHARDS)
    spec = BatchSpec(strategy="pack", seq_len=32, batch_size=2)
    holdings = Holdings(lambda s, n: DocStream(corpus, tok, s, n, scan=scan), spec, EPOCHS, np.int32)
    for s in range(SHARDS):
        holdings.start(s, SHARDS, "lease", Cursor(), 1)
    sent = 0
    while holdings.next_message("session") is not None:  # the producer's order: fewest sent first
        sent += 1
    assert sent > SHARDS * EPOCHS
    assert corpus.reads == EPOCHS
    assert not scan.passes  # every queue let go at the end


def test_restarts_and_small_budgets_change_nothing(corpus_files, tok):
    alone, _ = run(corpus_files, tok, shared=False, order_seed=3, restarts=6)
    restarted, _ = run(corpus_files, tok, shared=True, order_seed=3, restarts=6)
    assert same(alone, restarted)
    for budget in (1, 3_000, 30_000):  # no queue at all; shards leaving passes midway
        small, reads = run(corpus_files, tok, shared=True, order_seed=3, budget=budget)
        assert same(alone, small), budget
        assert reads > EPOCHS + 2  # shards left their passes and read alone


def test_a_shard_given_up_leaves_no_queue(corpus_files, tok):
    corpus = Corpus(corpus_files)
    scan = SharedScan(corpus, SHARDS)
    spec = BatchSpec(strategy="pack", seq_len=32, batch_size=2)
    holdings = Holdings(
        lambda s, n: DocStream(corpus, tok, s, n, shuffle_window=8, encode_batch=4, scan=scan),
        spec,
        1,
        np.int32,
    )
    for s in range(SHARDS):
        holdings.start(s, SHARDS, "lease", Cursor(), 1)
    assert holdings.next_message("session") is not None  # shard 0 read: the others' records are queued
    assert any(scan.passes[0].queues[s] for s in range(1, SHARDS))
    holdings.keep_only([0])
    assert set(scan.passes[0].queues) == {0}
    assert scan.held == {0}


@pytest.mark.parametrize("budget", [1 << 30, 30_000])
def test_a_shard_epochs_ahead_of_slow_ones_keeps_passes_and_bytes_bounded(tmp_path, budget):
    """The shape that grew a producer to 15 GB: shard 1 owns small records and ends an epoch whenever it
    reads, shards 0 and 2 own huge ones and sit in one pass meanwhile. Each of shard 1's epochs starts a
    pass; the slow shards wait in at most PENDING_PASSES of them, so passes and queued bytes stay bounded
    (and within a small budget), and every shard still reads exactly its records, every epoch."""
    path = tmp_path / "mid.jsonl"
    lines = [
        json.dumps({"text": f"small {i}" if i % 3 == 1 else f"{i} " + "word " * 2000}) for i in range(12)
    ]
    path.write_text("".join(f"{line}\n" for line in lines))
    corpus = CountingCorpus([str(path)])
    scan = SharedScan(corpus, 3, budget=budget)
    for s in range(3):
        scan.hold(s)

    def reads(s: int):  # shard s reading epoch after epoch, a record at a time
        epoch = 0
        while True:
            for rec in scan.records(s):
                yield epoch, rec
            epoch += 1

    got: dict[int, list[list[tuple[int, str | None]]]] = {s: [] for s in range(3)}
    slow = {s: reads(s) for s in (0, 2)}
    most_passes = most_bytes = 0
    for _ in range(30):
        for s, it in slow.items():
            epoch, rec = next(it)
            if epoch == len(got[s]):
                got[s].append([])
            got[s][epoch].append((rec.rid, rec.text))
        for _ in range(10):
            got[1].append([(rec.rid, rec.text) for rec in scan.records(1)])
        held = sum(record_bytes(r) for p in scan.passes for q in p.queues.values() for r in q)
        assert held == scan.bytes
        most_passes, most_bytes = max(most_passes, len(scan.passes)), max(most_bytes, held)
    assert most_passes <= PENDING_PASSES + 1, most_passes  # not one per epoch of shard 1 (300 of them)
    assert most_bytes <= min(budget, (PENDING_PASSES + 1) * path.stat().st_size), most_bytes
    for s in range(3):
        want = [(rec.rid, rec.text) for rec in Corpus([str(path)]).records(s, 3)]
        assert len(got[s]) >= 7
        assert all(epoch == want for epoch in got[s][:-1]), s
        assert got[s][-1] == want[: len(got[s][-1])], s
    if budget > 4 * path.stat().st_size:  # the slow shards read the passes shard 1 starts: none of their own
        assert corpus.reads == len(got[1]), corpus.reads
