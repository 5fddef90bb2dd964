"""The receiver's wire limits against batches at the extremes, property-based.

The limits are the receiver's own (`Receiver(...).limits`, which `batch_limits` computes from the batch
geometry): every batch the four strategies make, from one-token documents to a single 1M-token document,
at every row/length combination, must pass `decode` and `batch_from_message` under them; every batch
altered into an invalid one must be rejected, under the reason the receiver counts it by.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.receiver import Receiver
from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.shared.batch import Batch, batch_from_message
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.wire import STRATEGIES, WireError, decode, encode
from tests.helpers import ListStream

VOCAB = 50_000


def receiver_limits(batch_size: int, seq_len: int):
    """The limits a real trainer's receiver enforces for this geometry (the receiver is not started)."""
    cfg = PipelineConfig(batch_size=batch_size, seq_len=seq_len, producers=1)
    return Receiver(cfg, {}, [], Ledger(1, "s"), TrainerMetrics(), VOCAB).limits


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def received(frames: list[Any], spec: BatchSpec) -> Batch:
    """What the receiver does with a message: decode under its limits, then check the batch's meaning."""
    limits = receiver_limits(spec.batch_size, spec.seq_len)
    return batch_from_message(decode(as_bytes(frames), limits), VOCAB, spec.seq_len, spec.batch_size)


def all_batches(docs: list[list[int]], spec: BatchSpec, dtype=np.uint16) -> list[Batch]:
    return list(batches(ListStream(docs), spec, epochs=1, dtype=dtype))


def assert_accepted(docs: list[list[int]], spec: BatchSpec, dtype=np.uint16) -> list[Batch]:
    out = all_batches(docs, spec, dtype)
    limits = receiver_limits(spec.batch_size, spec.seq_len)
    for b in out:
        frames = as_bytes(b.to_frames("s", 0, 1))
        assert max(len(f) for f in frames) <= limits.max_frame_bytes  # ZeroMQ's guard is above this
        got = received(frames, spec)
        np.testing.assert_array_equal(got.doc_len, b.doc_len)
    assert sum(b.real_tokens for b in out) == sum(len(d) for d in docs)
    return out


# documents down to one token (short ones are what a fixed bound on pieces got wrong), and long ones
doc_lists = st.one_of(
    st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=3), min_size=1, max_size=400),
    st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=150), min_size=1, max_size=30),
)
specs = st.builds(
    BatchSpec,
    strategy=st.sampled_from(STRATEGIES),
    seq_len=st.integers(2, 64),
    batch_size=st.integers(1, 16),
    bucket_k=st.integers(0, 8),
    bucket_window=st.integers(1, 64),
    pad_multiple=st.sampled_from([1, 8]),
)


@settings(max_examples=200, deadline=None)
@given(docs=doc_lists, spec=specs, wide=st.booleans())
def test_every_batch_a_strategy_makes_is_accepted(docs, spec, wide):
    assert_accepted(docs, spec, np.int32 if wide else np.uint16)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_len", [2, 3, 17, 64])
def test_every_row_and_length_combination_is_accepted(strategy, batch_size, seq_len):
    # every document length from 1 to 2T + 1: pieces that fill a row, split across rows, or are 1 token
    docs = [list(range(1, n + 1)) for n in range(1, 2 * seq_len + 2)] * 2
    spec = BatchSpec(strategy=strategy, seq_len=seq_len, batch_size=batch_size, bucket_k=2, bucket_window=16)
    assert_accepted(docs, spec)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size,seq_len", [(1, 2), (4, 7), (64, 512)])
def test_one_token_documents_fill_a_batch_with_a_piece_per_token(strategy, batch_size, seq_len):
    spec = BatchSpec(strategy=strategy, seq_len=seq_len, batch_size=batch_size)
    n = batch_size * seq_len * 2 if strategy == "pack" else batch_size * 3
    out = assert_accepted([[7]] * n, spec)
    if strategy == "pack":  # the extreme a valid batch can reach: B*T pieces
        assert max(len(b.doc_id) for b in out) == batch_size * seq_len


def test_the_issue_corpus_at_seq_len_512_and_64_rows():
    """Short documents at T=512, B=64 made batches of ~600 pieces, over the old bound max(B, T)."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, VOCAB, size=rng.integers(2, 8))) for _ in range(12_000)]
    out = assert_accepted(docs, BatchSpec(strategy="pack", seq_len=512, batch_size=64))
    assert max(len(b.doc_id) for b in out) > 512


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size,seq_len", [(4, 2048), (1, 65535)])
def test_a_single_million_token_document(strategy, batch_size, seq_len):
    doc = (np.arange(1_000_000) % (VOCAB - 1) + 1).tolist()
    out = assert_accepted([doc], BatchSpec(strategy=strategy, seq_len=seq_len, batch_size=batch_size))
    starts = sorted(s for b in out for s in b.doc_start.tolist())
    assert starts[0] == 0 and len(starts) == -(-1_000_000 // seq_len)


# -- invalid batches: rejected, by reason ------------------------------------------------------------


def _header(b: Batch, **counts: int) -> dict[str, Any]:
    c = {"tokens": b.real_tokens, "pad": b.pad_tokens, "docs": len(b.doc_id)}
    c.update(counts)
    return {"kind": "batch", "session": "s", "shard": 0, "seq": 1, "cursor": b.cursor.to_dict(),
            "strategy": b.strategy, "counts": c}  # fmt: skip


def _merge_across_rows(b: Batch, a: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The last piece of row 0 and the first of row 1 become one piece that crosses the row boundary."""
    if b.rows < 2 or b.lengths[0] == 0 or b.lengths[1] == 0:
        return None
    k = int(np.searchsorted(np.cumsum(b.doc_len), b.lengths[0]))  # index of row 0's last piece
    a["doc_len"] = np.concatenate(
        [b.doc_len[:k], [b.doc_len[k] + b.doc_len[k + 1]], b.doc_len[k + 2 :]]
    ).astype(np.int32)
    a["doc_id"] = np.delete(b.doc_id, k + 1)
    a["doc_start"] = np.delete(b.doc_start, k + 1)
    return {"docs": len(b.doc_id) - 1}


def _mutate(name: str, b: Batch, spec: BatchSpec) -> tuple[list[Any], str] | None:
    """An invalid message made from a valid batch `b`, and the reason it must be rejected with."""
    a = dict(b.arrays())
    B, T, cells = spec.batch_size, spec.seq_len, spec.batch_size * spec.seq_len
    counts: dict[str, int] = {}
    if name == "more rows than the slots":
        a["tokens"] = np.zeros((B + 1, b.width), b.tokens.dtype)
        reason = "bad_shape"
    elif name == "wider than seq_len":
        a["tokens"] = np.zeros((b.rows, T + 1), b.tokens.dtype)
        reason = "bad_shape"
    elif name == "more pieces than tokens":
        a["doc_id"] = np.zeros(cells + 1, np.int64)
        reason = "bad_shape"
    elif name == "3-d tokens":
        a["tokens"] = a["tokens"].reshape(1, *b.tokens.shape)
        reason = "bad_shape"
    elif name == "an array nobody asked for":
        a["extra"] = np.zeros(1, np.uint8)
        reason = "bad_header"
    elif name == "token id outside the vocabulary":
        a["tokens"] = b.tokens.astype(np.int32)
        a["tokens"][0, 0] = VOCAB
        reason = "bad_batch"
    elif name == "an empty piece":
        a["doc_len"] = np.concatenate([b.doc_len, [0]]).astype(np.int32)
        a["doc_id"] = np.concatenate([b.doc_id, [1]])
        a["doc_start"] = np.concatenate([b.doc_start, [0]]).astype(np.int32)
        counts = {"docs": len(b.doc_id) + 1}
        reason = "bad_batch"
    elif name == "document count off":
        counts = {"docs": len(b.doc_id) + 1}
        reason = "bad_batch"
    elif name == "token count off":
        counts = {"tokens": b.real_tokens + 1}
        reason = "bad_batch"
    elif name == "a length past the row":
        a["lengths"] = b.lengths.copy()
        a["lengths"][0] = b.width + 1
        reason = "bad_batch"
    elif name == "lengths as int64":
        a["lengths"] = b.lengths.astype(np.int64)
        reason = "bad_batch"
    elif name == "a piece across rows":
        got = _merge_across_rows(b, a)
        if got is None:
            return None
        counts = got
        reason = "bad_batch"
    elif name == "truncated frame":
        frames = as_bytes(encode(_header(b), a))
        frames[1] = frames[1][:-1]
        return frames, "truncated"
    else:
        raise AssertionError(name)
    return encode(_header(b, **counts), a), reason


MUTATIONS = [
    "more rows than the slots", "wider than seq_len", "more pieces than tokens", "3-d tokens",
    "an array nobody asked for", "token id outside the vocabulary", "an empty piece", "document count off",
    "token count off", "a length past the row", "lengths as int64", "a piece across rows", "truncated frame",
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(docs=doc_lists, spec=specs, mutation=st.sampled_from(MUTATIONS), pick=st.integers(0, 10_000))
def test_every_invalid_batch_is_rejected_by_reason(docs, spec, mutation, pick):
    out = all_batches(docs, spec)
    b = out[pick % len(out)]
    made = _mutate(mutation, b, spec)
    if made is None:  # not applicable to this batch (e.g. one row)
        return
    frames, reason = made
    with pytest.raises(WireError) as err:
        received(frames, spec)
    assert err.value.reason == reason, err.value


def test_a_rejected_batch_still_names_its_sender():
    spec = BatchSpec(strategy="pack", seq_len=8, batch_size=2)
    (b,) = all_batches([[1, 2, 3]], spec)
    hdr = dict(_header(b), shard=0, seq=17)
    frames = as_bytes(encode(hdr, {**b.arrays(), "doc_id": np.zeros(17, np.int64)}))
    with pytest.raises(WireError) as err:
        decode(frames, receiver_limits(2, 8))
    assert err.value.reason == "bad_shape" and err.value.header["seq"] == 17
