"""Checkpoints, resume and crashes: nothing lost, nothing repeated (real processes, CPU).

What "exactly once" means when a trainer is killed: the steps it took after its last checkpoint are lost
with it, and their batches are trained again after the restart. So the documents trained on are those of
the first session's steps below the resumed checkpoint's step S, plus everything the resumed session
trained; over one epoch that must cover every token of every document exactly once. The replayed batches
are also checked to be the very same batches (same worker, sequence number and document pieces).
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from lmpipe.consumer.checkpoint import CheckpointError, CheckpointManager, compare
from lmpipe.producer.shards import ShardError, ShardSet, prepare
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream


def test_shards_round_trip_the_tokenizer_exactly(tmp_path, tok):
    src = tmp_path / "c.jsonl"
    rng = random.Random(0)
    with open(src, "w") as f:
        for i in range(300):
            f.write(
                json.dumps(
                    {
                        "text": f"doc {i}: "
                        + " ".join(rng.choice(["alpha", "beta", "é", "x"]) for _ in range(i % 40))
                    }
                )
                + "\n"
            )
            if i % 50 == 0:
                f.write("{broken\n")
    corpus = Corpus([str(src)])
    meta = prepare(
        DocStream(corpus, tok, shuffle_window=0), tmp_path / "sh", shard_tokens=1000, progress=False
    )
    assert len(meta["shards"]) > 3 and meta["tokenizer_hash"] == tok.hash
    text_docs = {d.doc_id: d.ids for d in DocStream(corpus, tok, shuffle_window=0).docs(0)}
    shard_corpus = Corpus([str(tmp_path / "sh")])
    shard_docs = {d.doc_id: d.ids for d in DocStream(shard_corpus, tok, shuffle_window=0).docs(0)}
    assert shard_docs.keys() == text_docs.keys() and len(shard_docs) == 300
    for k, ids in text_docs.items():
        np.testing.assert_array_equal(shard_docs[k], ids)
    # sharded across two workers, shuffled: still a partition of the same documents
    split = [[d.doc_id for d in DocStream(shard_corpus, tok, w, 2, seed=5).docs(0)] for w in range(2)]
    assert sorted(split[0] + split[1]) == sorted(text_docs) and split[0] != sorted(split[0])


def test_corrupt_shards_are_detected(tmp_path, tok):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"paragraph {i} " * (i % 7 + 1) for i in range(100)))
    prepare(DocStream(Corpus([str(src)]), tok, shuffle_window=0), tmp_path / "sh", progress=False)
    sh = tmp_path / "sh"
    ShardSet(sh)  # intact: opens
    toks = sh / "tokens-00000.bin"
    good = toks.read_bytes()
    toks.write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    with pytest.raises(ShardError, match="tokens-00000.bin: checksum mismatch"):
        ShardSet(sh)
    toks.write_bytes(good)
    index = sh / "index-00000.bin"
    idx = np.fromfile(index, dtype="<i8")
    index.write_bytes(idx[:-1].tobytes())
    with pytest.raises(ShardError, match="index-00000.bin: .* bytes, meta.json says"):
        ShardSet(sh)
    bad = idx.copy()
    bad[5], bad[6] = bad[6], bad[5]
    index.write_bytes(bad.tobytes())
    with pytest.raises(ShardError, match="offsets are not a valid index"):
        ShardSet(sh, verify_checksums=False)
    with pytest.raises(ShardError, match="already exists"):
        prepare(DocStream(Corpus([str(src)]), tok, shuffle_window=0), sh, progress=False)


def test_ranks_and_workers_partition_the_corpus(tok):
    corpus = Corpus(builtin_docs=500)
    seen = []
    for rank in range(3):
        for w in range(2):
            seen += [d.doc_id for d in DocStream(corpus, tok, w, 2, rank=rank, world_size=3).docs(0)]
    assert sorted(seen) == list(range(500))


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    """On a full disk torch.save raised RuntimeError ('unexpected pos'): a traceback, and the partial
    temporary folder kept the space a retry needed."""
    ck = CheckpointManager(tmp_path / "ck")
    good = ck.save(1, {}, {"w": torch.zeros(1)})

    def disk_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3748672 vs 3748560")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(
        OSError, match=r"could not write checkpoint step 2 in .*ck \([\d,]+ MiB free there\): \[enf"
    ):
        ck.save(2, {}, {"w": torch.ones(1)})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-00000001"]
    assert ck.latest() == good


@pytest.mark.parametrize("keep", [1, 2])
def test_a_checkpoint_just_written_is_never_pruned(tmp_path, keep):
    """A run resumed from step 15 of a folder that also holds step 20 writes step 17: that is the one to
    keep and resume from, though a higher step number is beside it."""
    ck = CheckpointManager(tmp_path, keep=3)
    for step in (15, 20):
        ck.save(step, {}, {"w": torch.zeros(1)})
    resumed = CheckpointManager(tmp_path, keep=keep)
    written = resumed.save(17, {}, {"w": torch.ones(1)})
    left = [p.name for p in resumed.list()]
    assert written.name in left and len(left) == keep, left
    assert resumed.latest() == written
    if keep == 2:
        assert left == ["step-00000017", "step-00000020"]  # the newer of the others stays


@pytest.mark.parametrize("pointer", [b"step-00000020\n", b"\x00\xe3\x81binary", b"step-00000002\n{...}\n"])
def test_a_users_folders_and_a_damaged_latest_pointer_are_not_checkpoints(tmp_path, pointer):
    """A renamed copy (step-00000020-good) was resumed from and then crashed the run at its end (int() of
    the folder's name), losing every step since; a step-best folder stopped a fresh run; a latest pointer
    written over with binary or several lines gave a decode error or a multi-KB 'File name too long'."""
    ck = CheckpointManager(tmp_path, keep=5)
    for step in (2, 20):
        ck.save(step, {}, {"w": torch.zeros(1)})
    (tmp_path / "step-00000020").rename(tmp_path / "step-00000020-good")
    (tmp_path / "step-best").mkdir()
    (tmp_path / "latest").write_bytes(pointer)
    assert [p.name for p in ck.list()] == ["step-00000002"]
    assert ck.latest() == tmp_path / "step-00000002" and ck.latest_step() == 2
    ck.save(3, {}, {"w": torch.ones(1)})  # prunes its own only
    assert {"step-00000020-good", "step-best"} <= {p.name for p in tmp_path.iterdir()}
    assert ck.latest_step() == 3


def test_only_order_deciding_settings_must_match_on_the_built_in_corpus_and_shards(tmp_path):
    """The built-in corpus and shards are shuffled whole or not at all, and have no text to split: another
    --shuffle-window above 1 or another --doc-split resumes them. A text corpus's window decides its order."""
    stream = {"seq_len": 64, "shuffle_window": 1000, "doc_split": "blank", "seed": 0}
    for data in ("builtin:0:20000", "shards:abc:10:100:1"):
        header = {"data": data, "stream": stream}
        compare(header, {"stream": {**stream, "shuffle_window": 50, "doc_split": "heading"}}, tmp_path)
        with pytest.raises(CheckpointError, match="stream.shuffle_window: checkpoint has 'whole epoch', "
                           "this run has 'none'"):  # fmt: skip
            compare(header, {"stream": {**stream, "shuffle_window": 1}}, tmp_path)
        with pytest.raises(CheckpointError, match="stream.seed: checkpoint has 0, this run has 1"):
            compare(header, {"stream": {**stream, "seed": 1}}, tmp_path)
    header = {"data": "blank|a.txt:10", "stream": stream}
    for other in ({"shuffle_window": 50}, {"doc_split": "heading"}):
        with pytest.raises(CheckpointError, match=f"stream.{next(iter(other))}: checkpoint has"):
            compare(header, {"stream": {**stream, **other}}, tmp_path)


def test_another_max_line_bytes_is_refused_on_resume_of_a_text_corpus(tmp_path):
    """--max-line-bytes decides which lines a text document keeps, so the cursors of a checkpoint written
    with another value point into other documents: resumed, 56 pieces were trained twice and one not at all.
    A header written before it was kept resumes with the default; the built-in corpus and shards ignore it."""
    from lmpipe.consumer.checkpoint import read_header
    from lmpipe.shared.config import MAX_LINE_BYTES, PipelineConfig

    stream = PipelineConfig().stream_fields()
    assert stream["max_line_bytes"] == MAX_LINE_BYTES
    header = {"data": "blank|a.txt:10", "stream": stream}
    with pytest.raises(
        CheckpointError, match=f"stream.max_line_bytes: checkpoint has {MAX_LINE_BYTES}, this run has 300"
    ):
        compare(header, {"stream": {**stream, "max_line_bytes": 300}}, tmp_path)
    compare(
        {**header, "data": "shards:abc:10:100:1"}, {"stream": {**stream, "max_line_bytes": 300}}, tmp_path
    )
    old = {k: v for k, v in stream.items() if k != "max_line_bytes"}
    (tmp_path / "header.json").write_text(
        json.dumps({"format_version": 3, "data": header["data"], "stream": old})
    )
    compare(read_header(tmp_path), {"stream": stream}, tmp_path)


@pytest.mark.parametrize(
    "have, want, refused",
    [(2, 3, None), (2, 0, None), (2, 2, None), (2, 1, "resume with --epochs 2 or more (0: until stopped); "
     "to train fewer"), (0, 3, "resume with --epochs 0 (until stopped); to train a number of epochs")],
)  # fmt: skip
def test_epochs_may_go_up_on_resume_not_down(tmp_path, have, want, refused):
    """An epoch's order depends only on the seed and its number, so more epochs (or 0, until stopped) go
    on from a checkpoint's cursors; fewer, or a number after 0, could leave a cursor past the new end."""
    stream = {"seq_len": 64, "shuffle_window": 1000, "doc_split": "blank", "seed": 0}
    header = {"data": "blank|a.txt:10", "stream": {**stream, "epochs": have}}
    expected = {"stream": {**stream, "epochs": want}}
    if refused is None:
        compare(header, expected, tmp_path)
    else:
        with pytest.raises(CheckpointError, match=re.escape(refused)):
            compare(header, expected, tmp_path)


def test_a_checkpoint_that_read_a_file_twice_is_refused_with_why(tmp_path, monkeypatch):
    """lmpipe before 2026-11-27 trained a file reached twice (`--data a.txt a.txt`) twice an epoch; it now
    reads it once, so such a checkpoint cannot resume, and "resume with the same --data" was wrong advice."""
    from lmpipe.consumer import checkpoint
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.launch import check_resume_corpus
    from lmpipe.producer.sources import Corpus
    from lmpipe.shared.settings import SettingsError

    a = tmp_path / "a.txt"
    a.write_text("one document\n\nanother\n")
    corpus = Corpus([str(a), str(a)])
    split, _, files = corpus.fingerprint().partition("|")
    header = {"data": f"{split}|{files}|{files}"}  # what the older version recorded
    monkeypatch.setattr(checkpoint, "resolve_resume", lambda *_: tmp_path / "step-00000004")
    monkeypatch.setattr(checkpoint, "read_header", lambda _path: header)
    tcfg = TrainConfig(checkpoint_dir=str(tmp_path), resume="auto", metrics_port=None)
    with pytest.raises(SettingsError, match="more than once an epoch, which lmpipe now reads once"):
        check_resume_corpus(corpus, tcfg)
    header["data"] = f"{split}|{files}"
    check_resume_corpus(corpus, tcfg)  # the same files once: resumes
