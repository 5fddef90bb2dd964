"""The four strategies, property-based: nothing lost or invented, shapes and bounds hold, cursors resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.batch import Batch
from tests.helpers import PAD, ListStream

doc_lists = st.lists(st.lists(st.integers(1, 500), min_size=1, max_size=90), min_size=1, max_size=40)
specs = st.builds(
    BatchSpec,
    strategy=st.sampled_from(["pad", "pad-batch", "bucket", "pack"]),
    seq_len=st.integers(2, 48),
    batch_size=st.integers(1, 6),
    bucket_k=st.integers(0, 12),
    bucket_window=st.integers(1, 30),
    pad_multiple=st.sampled_from([1, 8]),
    seed=st.integers(0, 3),
)


def rebuild(out: list[Batch]) -> dict[int, dict[int, np.ndarray]]:
    """doc id -> {start: tokens} read back from the rows, using only what travels on the wire."""
    pieces: dict[int, dict[int, np.ndarray]] = {}
    for b in out:
        k = 0
        for r in range(b.rows):
            fill = 0
            while fill < b.lengths[r]:
                did, start, n = int(b.doc_id[k]), int(b.doc_start[k]), int(b.doc_len[k])
                assert start not in pieces.setdefault(did, {}), "a piece arrived twice"
                pieces[did][start] = b.tokens[r, fill : fill + n].astype(np.int64)
                if b.seg is not None:
                    assert len(set(b.seg[r, fill : fill + n].tolist())) == 1, (
                        "one document piece, one segment id"
                    )
                fill += n
                k += 1
                if b.seg is None:
                    break
            assert fill == b.lengths[r]
        assert k == len(b.doc_id), "every listed piece was found in the rows"
    return pieces


@settings(max_examples=150, deadline=None)
@given(docs=doc_lists, spec=specs)
def test_no_token_lost_or_invented(docs, spec):
    stream = ListStream(docs)
    out = list(batches(stream, spec, epochs=1))
    pieces = rebuild(out)
    assert sorted(pieces) == [1000 + i for i in range(len(docs))]
    for i, d in enumerate(docs):
        got = pieces[1000 + i]
        joined = np.concatenate([got[s] for s in sorted(got)])
        np.testing.assert_array_equal(joined, d)
        assert sorted(got)[0] == 0


@settings(max_examples=150, deadline=None)
@given(docs=doc_lists, spec=specs)
def test_shapes_padding_and_bounds(docs, spec):
    out = list(batches(ListStream(docs), spec, epochs=1))
    for i, b in enumerate(out):
        last = i == len(out) - 1
        assert 1 <= b.rows <= spec.batch_size
        assert b.tokens.shape[1] <= spec.seq_len
        assert b.pad_tokens == b.rows * b.width - int(b.lengths.sum())
        for r in range(b.rows):
            assert (b.tokens[r, b.lengths[r] :] == PAD).all(), "everything past the length is pad"
        if spec.strategy == "pack":
            assert b.width == spec.seq_len
            full = b.lengths == spec.seq_len
            assert full[:-1].all(), "every row but the run's last is exactly T tokens"
            if not last:
                assert full.all() and b.rows == spec.batch_size
            # pads never share a segment with real tokens
            for r in range(b.rows):
                L = b.lengths[r]
                if b.width > L:
                    assert b.seg[r, L] != b.seg[r, L - 1]
        elif spec.strategy == "pad":
            assert b.width == spec.seq_len
        else:
            longest = int(b.lengths.max())
            assert longest <= b.width < longest + spec.pad_multiple or b.width == spec.seq_len
        if spec.strategy == "bucket":
            assert int(b.lengths.max()) - int(b.lengths.min()) <= spec.bucket_k


@settings(max_examples=100, deadline=None)
@given(docs=doc_lists, spec=specs, cut=st.integers(0, 1000))
def test_resume_at_any_cursor_gives_the_same_batches(docs, spec, cut):
    stream = ListStream(docs)
    full = list(batches(stream, spec, epochs=1))
    i = cut % len(full)
    resumed = list(batches(stream, spec, start=full[i].cursor, epochs=1))
    assert len(resumed) == len(full) - i - 1
    for a, b in zip(full[i + 1 :], resumed):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.doc_id, b.doc_id)
        np.testing.assert_array_equal(a.doc_start, b.doc_start)
        assert a.cursor == b.cursor


def test_pack_segments_restart_at_document_boundaries():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    (b,) = batches(ListStream(docs), BatchSpec(strategy="pack", seq_len=6, batch_size=2), epochs=1)
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, PAD, PAD]]
    assert b.seg.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert b.lengths.tolist() == [6, 4]
    assert list(zip(b.doc_id.tolist(), b.doc_start.tolist(), b.doc_len.tolist())) == [
        (1000, 0, 3),
        (1001, 0, 2),
        (1002, 0, 1),
        (1002, 1, 4),
    ]
    # targets: within documents only; the row's last token and pads have none
    assert b.num_targets() == (2 + 1 + 0) + 3


def test_real_stream_is_deterministic_and_shuffled_per_epoch(tmp_path, tok):
    path = tmp_path / "c.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document number {i} " + "word " * (i % 17)}) + "\n")

    def ids(worker, epoch, window=16):
        s = DocStream(Corpus([str(path)]), tok, worker, 2, seed=3, shuffle_window=window)
        return [d.doc_id for d in s.docs(epoch)]

    a0, b0 = ids(0, 0), ids(1, 0)
    assert sorted(a0 + b0) == list(range(200)), "workers split the corpus without overlap"
    assert all(i % 2 == 0 for i in a0)
    assert a0 == ids(0, 0), "same seed, same order"
    assert a0 != ids(0, 1), "each epoch is shuffled differently"
    assert a0 != sorted(a0)
    assert ids(0, 0, window=1) == sorted(a0), "window 1 keeps corpus order"
    s = DocStream(Corpus([str(path)]), tok, 0, 2, seed=3, shuffle_window=16)
    assert [d.doc_id for d in s.docs(0, start_pos=37)] == a0[37:], "a position names the same document"


def test_bad_spec_is_refused():
    with pytest.raises(ValueError, match="unknown strategy"):
        BatchSpec(strategy="zip")


@pytest.mark.parametrize("k", [0, 3, 7])
def test_bucket_bound_is_tight_on_every_length(k):
    rng = np.random.default_rng(k)
    docs = [list(range(1, n + 1)) for n in rng.permutation(np.repeat(np.arange(1, 61), 5))]
    spec = BatchSpec(strategy="bucket", seq_len=64, batch_size=4, bucket_k=k, bucket_window=1000)
    out = list(batches(ListStream(docs), spec, epochs=1))
    spreads = [int(b.lengths.max() - b.lengths.min()) for b in out]
    assert max(spreads) <= k
    if k:
        assert max(spreads) == k, "buckets are as wide as allowed, not narrower"
    # bucketing is the point: far less padding than padding each batch to its longest row
    padded = list(
        batches(ListStream(docs), BatchSpec(strategy="pad-batch", seq_len=64, batch_size=4), epochs=1)
    )
    assert sum(b.pad_tokens for b in out) < 0.3 * sum(b.pad_tokens for b in padded)


@settings(max_examples=100, deadline=None)
@given(docs=doc_lists, spec=specs.filter(lambda s: s.strategy == "pack"), cut=st.integers(0, 1000))
def test_pack_rows_run_on_across_epochs_and_resume_there(docs, spec, cut):
    stream = ListStream(docs)
    out = list(batches(stream, spec, epochs=3))
    for b in out[:-1]:
        assert b.rows == spec.batch_size and (b.lengths == spec.seq_len).all(), (
            "only the run's last batch is short"
        )
    tokens = sum(b.real_tokens for b in out)
    assert tokens == 3 * sum(len(d) for d in docs)
    i = cut % len(out)
    resumed = list(batches(stream, spec, start=out[i].cursor, epochs=3))
    assert [b.cursor for b in resumed] == [b.cursor for b in out[i + 1 :]]
    for a, b in zip(out[i + 1 :], resumed):
        np.testing.assert_array_equal(a.tokens, b.tokens)
