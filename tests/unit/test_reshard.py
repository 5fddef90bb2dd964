"""The division of a run's global shards among trainer ranks (consumer/reshard.py), the cursors a resume on
another world size hands each rank, and the welcome that tells producers which global shards they make."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmpipe.consumer.checkpoint import CheckpointError
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.reshard import Layout, global_batch, plan, rank_state, say_resize, split
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.wire import WireError


@pytest.mark.parametrize("space", [1, 2, 3, 4, 7, 16, 32])
def test_every_global_shard_goes_to_exactly_one_rank_and_shares_are_balanced(space):
    for world in range(1, space + 1):
        spans = [split(space, world, r) for r in range(world)]
        assert [g for lo, hi in spans for g in range(lo, hi)] == list(range(space))  # contiguous, in order
        sizes = [hi - lo for lo, hi in spans]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_the_first_starts_world_size_gives_todays_layout():
    # rank r of N with S shards each owned global shards r*S .. r*S+S-1 before resizing existed
    for n, s in [(1, 16), (2, 16), (4, 3), (3, 5)]:
        for r in range(n):
            assert split(n * s, n, r) == (r * s, r * s + s)
            fresh = plan(None, r, n, s)
            assert (fresh.first, fresh.count, fresh.space) == (r * s, s, n * s)
            assert not fresh.resized


def header(world: int, shards: int, **more: object) -> dict:
    return {"stream": {"world_size": world}, "shards": shards, "step": 10, **more}


def test_a_resume_keeps_the_checkpoints_shard_space():
    old = header(2, 3)  # an older checkpoint: no shard_space, 2 x 3 global shards
    assert plan(old, 0, 2, 3).first == 0 and not plan(old, 1, 2, 3).resized
    on3 = [plan(old, r, 3, 3) for r in range(3)]
    assert [(x.first, x.count) for x in on3] == [(0, 2), (2, 2), (4, 2)]
    assert on3[0].resized and on3[0].from_world == 2 and on3[0].from_step == 10
    # a checkpoint written after a resize says its space: 4 ranks of a 2 x 3 run, resumed on 1
    assert plan(header(4, 3, shard_space=6), 0, 1, 3) == Layout(6, 0, 6, 0, 1, 4, 10)
    with pytest.raises(CheckpointError, match="holds 6 shards and 7 ranks need one each at least"):
        plan(old, 0, 7, 3, "ck")


def cursors(first: int, n: int) -> list[dict]:
    """Distinct per-shard states, named by global shard."""
    return [
        {"cursor": {"epoch": 0, "pos": 100 + g}, "last_seq": g, "finished": False}
        for g in range(first, first + n)
    ]


@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 1), (2, 4), (4, 3), (3, 4), (2, 2)])
def test_each_global_shards_cursor_goes_to_the_one_rank_that_now_owns_it(old, new):
    space = 12
    by_rank = [cursors(lo, hi - lo) for lo, hi in (split(space, old, q) for q in range(old))]
    got = []
    for r in range(new):
        lo, hi = split(space, new, r)
        mine = rank_state(by_rank, Layout(space, lo, hi - lo, r, new, old), 1)
        assert [s["last_seq"] for s in mine] == list(range(lo, hi))
        got += mine
    assert got == cursors(0, space)


def test_a_mixtures_state_is_split_so_that_the_jobs_tokens_and_deficits_add_up():
    space, sources = 4, 2  # 2 ranks of 2 shards per source -> 3 ranks

    def mix_state(q: int) -> dict:  # fmt: skip
        lo, hi = split(space, 2, q)
        return {
            "shards": [c for i in range(sources) for c in cursors(100 * i + lo, hi - lo)],
            "mix": {"names": ["web", "code"], "step": 7, "weights": [0.7, 0.3],
                    "sources": [{"target": 70.5 + q, "trained": 71 + q, "rr": 1, "epoch": q},
                                {"target": 30.5, "trained": 30, "rr": 0, "epoch": 1}],
                    "rows_taken": [10 * i + g for i in range(sources) for g in range(lo, hi)]},
        }  # fmt: skip

    by_rank = [mix_state(0), mix_state(1)]
    states = [rank_state(by_rank, plan(header(2, 2), r, 3, 2), sources) for r in range(3)]
    rows = [[], []]
    for r, st in enumerate(states):
        lo, hi = split(space, 3, r)
        n = hi - lo
        assert [c["last_seq"] for c in st["shards"]] == [*range(lo, hi), *range(100 + lo, 100 + hi)]
        rows[0] += st["mix"]["rows_taken"][:n]
        rows[1] += st["mix"]["rows_taken"][n:]
        assert st["mix"]["step"] == 7 and st["mix"]["names"] == ["web", "code"]
    assert rows == [[0, 1, 2, 3], [10, 11, 12, 13]]
    for i, (trained, deficit, epoch) in enumerate([(143, 1.0 - 2.0, 0), (60, 1.0, 1)]):
        parts = [st["mix"]["sources"][i] for st in states]
        assert sum(p["trained"] for p in parts) == trained
        assert sum(p["target"] - p["trained"] for p in parts) == pytest.approx(deficit)
        assert max(p["trained"] for p in parts) - min(p["trained"] for p in parts) <= 1
        assert {p["epoch"] for p in parts} == {epoch}


def test_keep_global_batch_scales_accum_or_refuses_in_one_line():
    two = plan(header(2, 4, accum=3), 0, 1, 4)
    assert global_batch(two, TrainConfig(accum=3), "ck").accum == 3  # not asked: --accum as given
    keep = TrainConfig(accum=3, keep_global_batch=True)
    assert global_batch(two, keep, "ck").accum == 6
    assert "the global batch stays 48 rows (1 rank x --accum 6 x 8)" in say_resize(two, 6, 8)
    assert "goes from 48 rows (2 x --accum 3 x 8) to 24" in say_resize(two, 3, 8)
    four = replace(two, world=4)
    with pytest.raises(CheckpointError, match="2 ranks x --accum 3 = 6 batches, which 4 ranks cannot share"):
        global_batch(four, keep, "ck")
    assert global_batch(plan(header(2, 4), 0, 2, 4), keep, "ck").accum == 3  # same world size: unchanged
    with pytest.raises(CheckpointError, match="--keep-global-batch makes --accum 6: --slots 4 is fewer than"):
        global_batch(two, replace(keep, slots=4), "ck")


def test_a_welcome_names_the_global_shards_and_the_stream_makes_them(tok):
    w = messages.Welcome("s", 1, shards=2, first=5, space=12)
    back = messages.unpack(messages.pack(w))
    assert (back.first, back.space) == (5, 12)
    assert messages.unpack(messages.pack(messages.Welcome("s", 0))).space is None  # the producer's own layout
    for first, space in [(12, 12), (None, 12), (3, 5000)]:
        with pytest.raises(WireError, match="names no global shard"):
            messages.unpack(messages.pack(messages.Welcome("s", 0, first=first, space=space)))
    corpus = Corpus(builtin_docs=50)
    s = DocStream(corpus, tok, 1, 2, rank=1, world_size=2, first=5, space=12)
    assert (s.worker_global, s.total_workers) == (6, 12)
    assert sorted(d.doc_id for d in s.docs(0)) == [6, 18, 30, 42]  # record id % 12 == 6
    assert (DocStream(corpus, tok, 1, 2, rank=1, world_size=2).worker_global) == 3  # as before
    with pytest.raises(ValueError, match="out of range"):
        DocStream(corpus, tok, 1, 2, first=11, space=12)


def test_the_topology_is_in_the_metrics_and_the_summary():
    from prometheus_client import generate_latest

    from lmpipe.consumer.reshard import said, summary
    from lmpipe.shared.metrics import TrainerMetrics

    m = TrainerMetrics()
    fresh = plan(None, 1, 2, 8)
    said(fresh, 1, 4, m, main=False)
    text = generate_latest(m.registry).decode()
    assert "lmpipe_trainer_world_size 2.0" in text and "lmpipe_trainer_rank_shards 8.0" in text
    assert "lmpipe_trainer_resumed_step NaN" in text
    assert summary(fresh) == {"world_size": 2, "shards": 8, "shard_space": 16}
    resumed = plan(header(2, 8), 2, 3, 8)
    said(resumed, 1, 4, m, main=True)
    text = generate_latest(m.registry).decode()
    assert "lmpipe_trainer_resumed_step 10.0" in text and "lmpipe_trainer_resumed_world_size 2.0" in text
    assert "lmpipe_trainer_rank_shards 6.0" in text  # 16 shards on 3 ranks: 5, 5, 6
    assert summary(resumed)["resumed_world_size"] == 2
