"""The four batch strategies: pad, pad-batch, bucket, pack.

Each turns a worker's tokenized documents into fixed-shape batches and stamps every batch with the cursor
after it, so a producer restarted at that cursor makes exactly the batches that would have come next.

- pad:       one document piece per row, padded to seq_len (the naive baseline).
- pad-batch: one piece per row, padded to the longest row of the batch.
- bucket:    pieces of similar length batched together (longest - shortest <= k), padded to the longest.
             Pieces are grouped by length in windows: an O(n) index by length bucket, then O(batch) per batch.
- pack:      documents laid end to end in rows of exactly seq_len tokens; `seg` marks which document
             each token belongs to so attention and targets never cross documents. Rows run on from one
             epoch into the next: no pad except in the last row of a finite run, and before a document
             with loss-masked tokens (a prompt) that fits in a row but not in the rest of this one: it
             starts the next row, so its trained tokens see all of their context.

A piece is a document, or a seq_len-long slice of one that is longer (for the padding strategies).

Documents with a loss mask (Doc.mask) put `loss_mask` in the batches that hold them: the mask is cut and
laid out exactly as the tokens are, unmasked documents in the same batch get 1s and pad gets 0s. A batch
with no masked document carries no mask at all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np

from lmpipe.producer.stream import Doc, DocStream
from lmpipe.shared.batch import Batch, Cursor
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import inherit, validate

log = logging.getLogger("lmpipe.producer")


@dataclass(frozen=True)
class BatchSpec:
    """The batching part of PipelineConfig: the same settings, defaults and checks (`BatchSpec.of(cfg)`)."""

    strategy: str = inherit(PipelineConfig, "strategy")
    seq_len: int = inherit(PipelineConfig, "seq_len")
    batch_size: int = inherit(PipelineConfig, "batch_size")
    bucket_k: int = inherit(PipelineConfig, "bucket_k")  # bucket: longest - shortest row length <= k
    bucket_window: int = inherit(PipelineConfig, "bucket_window")  # bucket: pieces indexed together
    pad_multiple: int = inherit(PipelineConfig, "pad_multiple")  # pad-batch/bucket: bounded widths
    seed: int = inherit(PipelineConfig, "seed")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def of(cls, cfg: PipelineConfig) -> BatchSpec:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class Piece:
    doc: Doc
    start: int
    ids: np.ndarray
    after: Cursor  # where the stream stands once this piece is taken


def _pieces(docs: Iterator[Doc], seq_len: int, epoch: int, offset: int) -> Iterator[Piece]:
    for doc in docs:
        n = len(doc.ids)
        off, offset = offset, 0
        while off < n:
            end = min(off + seq_len, n)
            after = Cursor(epoch, doc.pos, end) if end < n else Cursor(epoch, doc.pos + 1, 0)
            yield Piece(doc, off, doc.ids[off:end], after)
            off = end


def _segments(pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array([p.doc.doc_id for p in pieces], dtype=np.int64),
        np.array([p.start for p in pieces], dtype=np.int32),
        np.array([len(p.ids) for p in pieces], dtype=np.int32),
    )


def _padded_batch(
    pieces: list[Piece], width: int, spec: BatchSpec, cursor: Cursor, pad_id: int, dtype
) -> Batch:
    tokens = np.full((len(pieces), width), pad_id, dtype=dtype)
    lengths = np.empty(len(pieces), dtype=np.int32)
    masked = any(p.doc.mask is not None for p in pieces)
    mask = np.zeros((len(pieces), width), dtype=np.uint8) if masked else None
    for r, p in enumerate(pieces):
        n = len(p.ids)
        tokens[r, :n] = p.ids
        lengths[r] = n
        if mask is not None:
            mask[r, :n] = 1 if p.doc.mask is None else p.doc.mask[p.start : p.start + n]
    doc_id, doc_start, doc_len = _segments(pieces)
    return Batch(tokens, lengths, doc_id, doc_start, doc_len, spec.strategy, cursor, loss_mask=mask)


def _width(pieces: list[Piece], spec: BatchSpec) -> int:
    if spec.strategy == "pad":
        return spec.seq_len
    longest = max(len(p.ids) for p in pieces)
    m = spec.pad_multiple
    return min(spec.seq_len, -(-longest // m) * m)


def _pad(docs: Iterator[Doc], spec: BatchSpec, start: Cursor, pad_id: int, dtype) -> Iterator[Batch]:
    buf: list[Piece] = []
    for p in _pieces(docs, spec.seq_len, start.epoch, start.offset):
        buf.append(p)
        if len(buf) == spec.batch_size:
            yield _padded_batch(buf, _width(buf, spec), spec, p.after, pad_id, dtype)
            buf = []
    if buf:
        yield _padded_batch(buf, _width(buf, spec), spec, buf[-1].after, pad_id, dtype)


def _bucket(
    docs: Iterator[Doc], spec: BatchSpec, start: Cursor, pad_id: int, dtype, worker: int
) -> Iterator[Batch]:
    pieces = _pieces(docs, spec.seq_len, start.epoch, start.offset)
    skip = start.skip
    while True:
        window: list[Piece] = []
        for p in pieces:
            window.append(p)
            if len(window) == spec.bucket_window:
                break
        if not window:
            return
        first = window[0]
        # O(n) index: bucket b holds lengths in [b*(k+1)+1, (b+1)*(k+1)], so max - min <= k
        buckets: dict[int, list[Piece]] = {}
        for p in window:
            buckets.setdefault((len(p.ids) - 1) // (spec.bucket_k + 1), []).append(p)
        groups = [
            b[i : i + spec.batch_size]
            for key in sorted(buckets)
            for b in (buckets[key],)
            for i in range(0, len(b), spec.batch_size)
        ]
        # Mix short and long batches; the order is a function of where the window starts, so a resume
        # at (window start, skip) rebuilds the same sequence.
        order = np.random.default_rng(
            [spec.seed, start.epoch, worker, first.doc.pos, first.start]
        ).permutation(len(groups))
        for j, g in enumerate(order):
            if j < skip:
                continue
            last = j + 1 == len(order)
            cursor = window[-1].after if last else Cursor(start.epoch, first.doc.pos, first.start, j + 1)
            yield _padded_batch(groups[g], _width(groups[g], spec), spec, cursor, pad_id, dtype)
        skip = 0


def _pack(
    docs: Iterator[tuple[int, Doc]], spec: BatchSpec, start: Cursor, pad_id: int, dtype
) -> Iterator[Batch]:
    """`docs` yields (epoch, doc) and may run on across epochs: rows fill up with the next epoch's
    documents, so only the run's very last batch can be short."""
    T, B = spec.seq_len, spec.batch_size

    def fresh() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # new arrays per batch: the previous ones may still be in flight as zero-copy frames
        return (
            np.full((B, T), pad_id, dtype=dtype),
            np.zeros((B, T), dtype=np.uint16),
            np.zeros(B, dtype=np.int32),
        )

    tokens, seg, lengths = fresh()
    mask: np.ndarray | None = None  # made when the batch's first masked document arrives
    segs: list[tuple[int, int, int]] = []
    row = fill = nseg = 0
    offset = start.offset
    last = Cursor(start.epoch, start.pos)  # where the stream stands after the last document taken
    for epoch, doc in docs:
        ids, n = doc.ids, len(doc.ids)
        off, offset = offset, 0
        last = Cursor(epoch, doc.pos + 1)
        if fill and fill + n - off > T and n - off <= T and _has_context(doc, off):
            # a prompt/completion that fits a row but not this one's rest starts the next row: cut at the
            # row end, its completion would be trained without the prompt in view. The rest is pad.
            seg[row, fill:] = nseg
            lengths[row] = fill
            if mask is not None:
                mask[row, fill:] = 0
            row, fill, nseg = row + 1, 0, 0
            if row == B:
                yield _packed(tokens, seg, lengths, segs, spec, Cursor(epoch, doc.pos, off), mask)
                tokens, seg, lengths = fresh()
                segs, row, mask = [], 0, None
        while off < n:
            take = min(T - fill, n - off)
            tokens[row, fill : fill + take] = ids[off : off + take]
            seg[row, fill : fill + take] = nseg
            if doc.mask is not None:
                if mask is None:  # everything laid out so far is unmasked: 1s, and pad 0s
                    mask = np.ones((B, T), dtype=np.uint8)
                    for r in range(row):
                        mask[r, lengths[r] :] = 0
                mask[row, fill : fill + take] = doc.mask[off : off + take]
            segs.append((doc.doc_id, off, take))
            fill += take
            off += take
            nseg += 1
            if fill == T:
                lengths[row] = T
                row, fill, nseg = row + 1, 0, 0
                if row == B:
                    cursor = Cursor(epoch, doc.pos, off) if off < n else last
                    yield _packed(tokens, seg, lengths, segs, spec, cursor, mask)
                    tokens, seg, lengths = fresh()
                    segs, row, mask = [], 0, None
    if fill:
        seg[row, fill:] = nseg  # pad tokens form their own segment: nothing attends to them
        lengths[row] = fill
        if mask is not None:
            mask[row, fill:] = 0
        row += 1
    if row:
        yield _packed(
            tokens[:row].copy(), seg[:row].copy(), lengths[:row].copy(), segs, spec, last,
            None if mask is None else mask[:row].copy(),
        )  # fmt: skip


def _has_context(doc: Doc, off: int) -> bool:
    """Whether the document (from `off` on) has loss-masked tokens: context its trained tokens need."""
    return doc.mask is not None and not bool(doc.mask[off:].all())


def _packed(tokens, seg, lengths, segs, spec: BatchSpec, cursor: Cursor, mask=None) -> Batch:
    arr = np.array(segs, dtype=np.int64).reshape(-1, 3)
    return Batch(
        tokens,
        lengths,
        arr[:, 0].copy(),
        arr[:, 1].astype(np.int32),
        arr[:, 2].astype(np.int32),
        spec.strategy,
        cursor,
        seg=seg,
        loss_mask=mask,
    )


_said_long_masked = False  # _LongMaskedWarning's line was said in this process (by any of its streams)


class _LongMaskedWarning:
    """Says once per process (not per stream: a producer holds a stream per shard) that a document with
    masked tokens (a prompt) is longer than a row: cut into rows, its later tokens (a completion) are trained
    without the rows before them in view."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def check(self, doc: Doc) -> None:
        global _said_long_masked
        if not _said_long_masked and len(doc.ids) > self.seq_len and _has_context(doc, 0):
            _said_long_masked = True
            log.warning(
                "document %d has loss-masked tokens and %d in all, over --seq-len %d: it is cut into rows, and "
                "a token trained in a later row does not see the rows before it (the start of its prompt); "
                "raise --seq-len or shorten such records (said once)",
                doc.doc_id,
                len(doc.ids),
                self.seq_len,
            )

    def docs(self, docs: Iterator[Doc]) -> Iterator[Doc]:
        for doc in docs:
            self.check(doc)
            yield doc

    def epochs(self, docs: Iterator[tuple[int, Doc]]) -> Iterator[tuple[int, Doc]]:
        for epoch, doc in docs:
            self.check(doc)
            yield epoch, doc


def batches(
    stream: DocStream, spec: BatchSpec, start: Cursor | None = None, epochs: int = 0, dtype=np.uint16
) -> Iterator[Batch]:
    """Batches from `start` on, through `epochs` epochs (0: forever)."""
    start = start or Cursor()
    pad_id = stream.tok.pad_id
    long_masked = _LongMaskedWarning(spec.seq_len)
    if spec.strategy == "pack":
        yield from _pack(long_masked.epochs(_epochs(stream, start, epochs)), spec, start, pad_id, dtype)
        return
    epoch, first = start.epoch, True
    while epochs == 0 or epoch < epochs:
        at = start if first else Cursor(epoch)
        docs = long_masked.docs(stream.docs(epoch, at.pos))
        produced = False
        if spec.strategy == "bucket":
            gen = _bucket(docs, spec, at, pad_id, dtype, stream.worker)
        else:
            gen = _pad(docs, spec, at, pad_id, dtype)
        for b in gen:
            produced = True
            yield b
        if not produced and at.pos == 0 and at.offset == 0:
            return  # this worker owns no documents: an endless loop of empty epochs helps nobody
        first = False
        epoch += 1


def _epochs(stream: DocStream, start: Cursor, epochs: int) -> Iterator[tuple[int, Doc]]:
    """(epoch, document) from `start` on, one epoch after another."""
    epoch, pos = start.epoch, start.pos
    while epochs == 0 or epoch < epochs:
        empty = True
        for doc in stream.docs(epoch, pos):
            empty = False
            yield epoch, doc
        if empty and pos == 0:
            return  # this worker owns no documents
        epoch, pos = epoch + 1, 0
