"""In-memory mixtures for the mixer's tests: a stand-in for shared/mix.py's Mix, shards' batches made by the
producer's batching from random short documents, and an assembled slot's rows."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lmpipe.consumer.slots import HostSlot
from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.shared.batch import Batch
from tests.helpers import ListStream

T, B, S = 16, 4, 2  # seq_len, rows per batch, shards per source


@dataclass
class FixedMix:
    weights: tuple[float, ...]
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()
    names_: tuple[str, ...] = ("web", "code", "math")

    def names(self) -> tuple[str, ...]:
        return self.names_[: len(self.weights)]

    def weights_at(self, step: int) -> tuple[float, ...]:
        w = self.weights
        if self.schedule:  # piecewise-linear, flat past the ends
            pts = self.schedule
            w = pts[0][1] if step <= pts[0][0] else pts[-1][1]
            for (s0, w0), (s1, w1) in zip(pts, pts[1:]):
                if s0 <= step < s1:
                    f = (step - s0) / (s1 - s0)
                    w = tuple(a + f * (b - a) for a, b in zip(w0, w1))
        total = sum(w)
        return tuple(x / total for x in w)


def shard_batches(shard: int, ndocs: int, spec: BatchSpec, seed: int = 0) -> list[Batch]:
    """A shard's deterministic batches: documents of 1..12 tokens, ids unique across shards."""
    rng = random.Random(shard * 1000 + seed)
    docs = [[rng.randrange(1, 90) for _ in range(rng.randint(1, 12))] for _ in range(ndocs)]
    out = list(batches(ListStream(docs), spec, epochs=1))
    for b in out:
        b.doc_id = b.doc_id + shard * 100_000
    return out


def rows_of(slot: HostSlot) -> list[tuple[int, ...]]:
    tokens, lengths, _ = slot.views()
    return [tuple(tokens[r, : int(lengths[r])].tolist()) for r in range(tokens.shape[0])]
