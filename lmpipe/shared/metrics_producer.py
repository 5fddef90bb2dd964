"""A producer's Prometheus metrics (the rules of shared/metrics.py hold here too).

Every series carries `producer`: this producer's own number (`--worker`, or the one `lmpipe run` gave it;
`unassigned` with --worker -1), which names it in logs as `[producer N]` and in the trainer's lines as
`producer N`. Where a producer tells its shards apart (it holds any number of them), the series carry
`shard` too: the trainer's id of the shard, the one its welcome names and the trainer's own per-shard series
(`lmpipe_trainer_batches_received_total{shard}`) and the doc log carry, so the two sides join on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase

from lmpipe.shared.metrics import (
    BAD_RECORD_REASONS,
    HANDSHAKE_RESULTS,
    LATENCY_BUCKETS,
    NAN,
    build_info,
    init_labels,
)

UNASSIGNED = "unassigned"  # the `producer` label of a producer without a number (--worker -1)


class _Bound:
    """A labelled family with its leading `producer` label filled in: `.labels(reason)` gives the child for
    (producer, reason), so callers count per reason without knowing about the producer label."""

    def __init__(self, family: MetricWrapperBase, producer: str):
        self.family, self.producer = family, producer

    def labels(self, *values: str) -> Any:
        return self.family.labels(self.producer, *values)


def _children(family: MetricWrapperBase) -> list[tuple[str, ...]]:
    """The label values of every series of a labelled family (a copy: safe to remove while looping)."""
    with family._lock:
        return list(getattr(family, "_metrics", {}))


class ProducerMetrics:
    """`bind` moves the series to another number: the old number's counters stay and its gauges are
    removed. `hold` and `sent` keep the per-shard gauges: one series per shard held, none for a shard given
    up."""

    def __init__(self, strategy: str = "pack", registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.strategy = strategy
        self.build = build_info(r, "producer")
        self.info = Info("lmpipe_producer", "Producer identity and configuration", registry=r)
        w = ["producer"]
        self._documents = Counter("lmpipe_producer_documents", "Documents tokenized", w, registry=r)
        self._tokens = Counter(
            "lmpipe_producer_tokens", "Real tokens sent in batches", [*w, "strategy"], registry=r
        )
        self._padding = Counter(
            "lmpipe_producer_padding_tokens", "Pad tokens sent in batches", [*w, "strategy"], registry=r
        )
        self._batches = Counter("lmpipe_producer_batches_sent", "Batches sent to the trainer", w, registry=r)
        self._bad_records = Counter(
            "lmpipe_producer_bad_records", "Corpus records skipped", [*w, "reason"], registry=r
        )
        self._tokenize = Histogram(
            "lmpipe_producer_tokenize_seconds",
            "Wall time of one encode_batch call (a chunk of documents)",
            w,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self._send_blocked = Counter(
            "lmpipe_producer_send_blocked_seconds",
            "Time a ready batch waited for the trainer (backpressure); grows while it waits",
            w,
            registry=r,
        )
        self._storage_wait = Counter(
            "lmpipe_producer_storage_wait_seconds",
            "Time spent in object-storage calls and the sleeps between their retries; grows while it waits",
            w,
            registry=r,
        )
        self._connected = Gauge(
            "lmpipe_producer_connected",
            "1 while a trainer serves this producer: welcomed, and its connection up (0 while it waits for one)",
            w,
            registry=r,
        )
        self._handshakes = Counter(
            "lmpipe_producer_handshakes",
            "Answers to this producer's hello: welcome, or refuse (it exits)",
            [*w, "result"],
            registry=r,
        )
        self._resets = Counter(
            "lmpipe_producer_stream_resets", "Stream restarts at a cursor the trainer sent", w, registry=r
        )
        ws = [*w, "shard"]
        self._cursor_pos = Gauge(
            "lmpipe_producer_cursor_position",
            "Per shard held: position in the shard's document order of its last batch sent (NaN before one)",
            ws,
            registry=r,
        )
        self._epoch = Gauge(
            "lmpipe_producer_epoch",
            "Per shard held: epoch of its last batch sent (NaN before one)",
            ws,
            registry=r,
        )
        self._shards_held = Gauge(
            "lmpipe_producer_shards_held",
            "Shards of the corpus the trainer gave this producer",
            w,
            registry=r,
        )
        self.worker = ""
        self.bind(-1)

    @property
    def families(self) -> list[MetricWrapperBase]:
        """The metric families (not their per-worker children)."""
        return [m for m in vars(self).values() if isinstance(m, MetricWrapperBase) and not m._labelvalues]

    def _remove(
        self,
        families: Iterable[MetricWrapperBase],
        producer: str,
        keep: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Remove the series of `producer` from `families`, but for the shards in `keep`."""
        for family in families:
            for values in _children(family):
                if values[0] == producer and not (len(values) > 1 and values[1] in keep):
                    family.remove(*values)

    def bind(self, worker: int) -> None:
        """Count from now on as `worker` (-1: not assigned yet)."""
        label = str(worker) if worker >= 0 else UNASSIGNED
        if label == self.worker:
            return
        old, self.worker = self.worker, label
        if old == UNASSIGNED:  # it only counted handshake answers, which the trainer counts too
            self._remove([f for f in self.families if f._labelnames], old)
        elif old:
            self._remove((self._connected, self._cursor_pos, self._epoch, self._shards_held), old)
        self.documents = self._documents.labels(label)
        self.batches = self._batches.labels(label)
        self.tokenize = self._tokenize.labels(label)
        self.send_blocked = self._send_blocked.labels(label)
        self.storage_wait = self._storage_wait.labels(label)
        self.resets = self._resets.labels(label)
        self.connected = self._connected.labels(label)  # 0 until the trainer welcomes it as this worker
        self.shards_held = self._shards_held.labels(label)
        self.tokens, self.padding = _Bound(self._tokens, label), _Bound(self._padding, label)
        self.bad_records, self.handshakes = _Bound(self._bad_records, label), _Bound(self._handshakes, label)
        self.tokens.labels(self.strategy)
        self.padding.labels(self.strategy)
        init_labels(self.bad_records, BAD_RECORD_REASONS)
        init_labels(self.handshakes, HANDSHAKE_RESULTS)

    def hold(self, shards: Iterable[int]) -> None:
        """The shards held now: each has its series (NaN until its first batch is sent; a shard held before
        keeps its figures), a shard given up has none; `shards_held` counts them."""
        keep = {str(s) for s in shards}
        self._remove((self._cursor_pos, self._epoch), self.worker, keep)
        held = {values[1] for values in _children(self._cursor_pos) if values[0] == self.worker}
        for s in keep - held:
            self._cursor_pos.labels(self.worker, s).set(NAN)
            self._epoch.labels(self.worker, s).set(NAN)
        self.shards_held.set(len(keep))

    def sent(self, shard: int, epoch: int, pos: int) -> None:
        """A batch of `shard` was built to be sent; it ends at document `pos` of epoch `epoch`."""
        self._cursor_pos.labels(self.worker, str(shard)).set(pos)
        self._epoch.labels(self.worker, str(shard)).set(epoch)
