"""A producer holds several shards: its cursor position and epoch are per shard (label `shard`, the trainer's
id of the shard), one series per shard held, so that they join the trainer's per-shard series."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from lmpipe.producer import manager
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics_producer import ProducerMetrics
from tests.helpers import short_texts


def _series(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    """{(producer, shard): value} of a per-shard gauge."""
    return {
        (s.labels["producer"], s.labels["shard"]): s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == name
    }


def test_a_series_per_shard_held_none_for_one_given_up():
    m = ProducerMetrics(registry=CollectorRegistry())
    m.bind(3)
    m.hold([1, 5])
    pos = _series(m.registry, "lmpipe_producer_cursor_position")
    assert set(pos) == {("3", "1"), ("3", "5")} and all(math.isnan(v) for v in pos.values())
    m.sent(1, 0, 40)
    m.sent(5, 1, 7)
    assert _series(m.registry, "lmpipe_producer_cursor_position") == {("3", "1"): 40, ("3", "5"): 7}
    assert _series(m.registry, "lmpipe_producer_epoch") == {("3", "1"): 0, ("3", "5"): 1}
    m.hold([5, 6])  # shard 1 moved to another producer, shard 6 came
    pos = _series(m.registry, "lmpipe_producer_cursor_position")
    assert set(pos) == {("3", "5"), ("3", "6")} and pos[("3", "5")] == 7 and math.isnan(pos[("3", "6")])
    assert m.registry.get_sample_value("lmpipe_producer_shards_held", {"producer": "3"}) == 2
    m.bind(4)  # another number: the old number's gauges go
    assert _series(m.registry, "lmpipe_producer_cursor_position") == {}


def test_each_shard_of_a_producer_reports_its_own_position(tmp_path):
    """A real producer, in this process, given shards 0 and 2 of 4 by an assign and their welcomes: after a
    few batches each shard's series says where that shard's stream is; the one given up has no series."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(short_texts(400)) + "\n")
    cfg = PipelineConfig(data=(str(corpus),), seq_len=16, batch_size=2, runtime_dir=str(tmp_path / "r"))
    p = manager.Producer(cfg, manager.ProducerOptions(worker=0))
    session = "s1"
    p._control(messages.pack(messages.Assign(session=session, shards=[0, 2], total=4)))
    for s in (0, 2):
        p._control(messages.pack(messages.Welcome(session=session, shard=s, lease=f"l{s}", shards=4)))
    reg = p.metrics.registry
    assert set(_series(reg, "lmpipe_producer_epoch")) == {("0", "0"), ("0", "2")}
    built: dict[int, int] = {}
    for _ in range(6):
        p._pending = None
        p._build()
        assert p._pending is not None
        h = p._pending[0]
        built[h.shard] = built.get(h.shard, 0) + 1
        pos = _series(reg, "lmpipe_producer_cursor_position")
        assert pos[("0", str(h.shard))] == h.end_cursor.pos, "the shard's own stream position"
    assert built == {0: 3, 2: 3}, "round robin over the shards held"
    pos = _series(reg, "lmpipe_producer_cursor_position")
    assert pos[("0", "0")] > 0 and pos[("0", "2")] > 0
    assert _series(reg, "lmpipe_producer_epoch") == {("0", "0"): 0, ("0", "2"): 0}
    p._control(messages.pack(messages.Assign(session=session, shards=[2], total=4)))  # shard 0 moved away
    assert set(_series(reg, "lmpipe_producer_cursor_position")) == {("0", "2")}
    assert reg.get_sample_value("lmpipe_producer_shards_held", {"producer": "0"}) == 1
