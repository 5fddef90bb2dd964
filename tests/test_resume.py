"""Checkpoints, resume and crashes: nothing lost, nothing repeated (real processes, CPU).

What "exactly once" means when a trainer is killed: the steps it took after its last checkpoint are lost
with it, and their batches are trained again after the restart. So the documents trained on are those of
the first session's steps below the resumed checkpoint's step S, plus everything the resumed session
trained; over one epoch that must cover every token of every document exactly once. The replayed batches
are also checked to be the very same batches (same worker, sequence number and document pieces).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lmpipe.consumer.checkpoint import CheckpointError, CheckpointManager, compare
from lmpipe.producer.shards import ShardError, ShardSet, prepare
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.tokenizer import train_tokenizer
from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    steps_logged,
    trained_pieces,
    wait_until,
)

pytestmark = pytest.mark.slow

SMALL = [
    "--builtin-docs",
    "240",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--bucket-window",
    "32",
    "--metrics-port",
    "-1",
]


def resumed_step(text: str) -> int:
    return int(text.split("resumed from ")[1].split(": step ")[1].split(",")[0])


@pytest.mark.parametrize("strategy", ["pack", "pad", "pad-batch", "bucket"])
@pytest.mark.parametrize("seed", [1, 2])
def test_kill_trainer_at_a_random_step(procs, tmp_path, port, tok, strategy, seed):
    common = ["--port", str(port), "--strategy", strategy, "--epochs", "1", "--producers", "2", *SMALL]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train_args = ["train", *common, "--steps", "0", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
                  "--doc-log", str(log), "--resume", "auto", "--log-every", "5"]  # fmt: skip
    t1 = procs.start(*train_args, name="trainer1")
    for w in range(2):
        procs.start("produce", *common, "--worker", str(w), name=f"producer{w}")
    kill_at = random.Random(seed * 100 + len(strategy)).randint(6, 25)
    wait_until(lambda: steps_logged(log) >= kill_at, 90, f"step {kill_at}")
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    first = doc_log_entries(log)
    first_session = first[0]["batches"][0]["session"]
    t2 = procs.start(*train_args, name="trainer2")
    assert t2.wait(timeout=120) == 0, procs.log(t2)
    text = procs.log(t2)
    assert "summary:" in text and "(end of data)" in text
    s = resumed_step(text)
    assert 4 <= s <= len(first) and s % 4 == 0  # the last checkpoint before the kill
    entries = doc_log_entries(log)
    assert_exactly_once(trained_pieces(entries, first_session, s), builtin_lengths(tok, 240))
    # the batches lost with the killed trainer came back identical
    key = lambda b: (b["worker"], b["seq"])  # noqa: E731
    lost = {key(b): b["docs"] for e in first if e["step"] >= s for b in e["batches"]}
    replayed = {
        key(b): b["docs"]
        for e in entries
        if e["batches"][0]["session"] != first_session
        for b in e["batches"]
    }
    # (none is lost when the kill lands right after a checkpoint)
    assert all(replayed[k] == docs for k, docs in lost.items())


@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_kill_a_producer_and_restart_it(procs, tmp_path, port, tok, strategy):
    # 1200 documents: enough that producer 1 is still mid-stream when it is killed (backpressure keeps it
    # only a few batches ahead of the trainer)
    common = [
        "--port",
        str(port),
        "--strategy",
        strategy,
        "--epochs",
        "1",
        "--producers",
        "2",
        *SMALL,
        "--builtin-docs",
        "1200",
    ]
    log = tmp_path / "docs.jsonl"
    train = procs.start(
        "train", *common, "--steps", "0", "--doc-log", str(log), "--threads", "1", name="trainer"
    )
    p0 = procs.start("produce", *common, "--worker", "0", name="producer0")
    p1 = procs.start("produce", *common, "--worker", "1", name="producer1")
    wait_until(lambda: steps_logged(log) >= 8, 90, "step 8")
    assert "finished" not in procs.log(p1)
    os.kill(p1.pid, signal.SIGKILL)
    p1.wait()
    time.sleep(1.0)
    # the killed producer's shards went to producer 0; the restarted one takes half of them back
    p1b = procs.start("produce", *common, name="producer1b")
    assert train.wait(timeout=120) == 0, procs.log(train)
    text = procs.log(train)
    assert "left (connection closed)" in text and re.search(
        r"producer p2 joined from .*\(from p[01]\)", text
    ), text
    assert re.search(r"the trainer assigned shards \d", procs.log(p1b))
    entries = doc_log_entries(log)
    assert len({b["session"] for e in entries for b in e["batches"]}) == 1
    assert_exactly_once(doc_pieces(entries), builtin_lengths(tok, 1200))
    assert p0.wait(timeout=10) == 0 and p1b.wait(timeout=10) == 0


def test_replicas_that_rejoin_a_restarted_trainer_late_or_frozen_get_shards_too(procs, tmp_path, port, tok):
    """Replicas (compose's producers) are interchangeable: after a trainer restart, one frozen while the
    others and a late replica rejoin still gets shards when it wakes, and nothing is trained twice."""
    common = ["--port", str(port), "--strategy", "pack", "--epochs", "1", "--producers", "3", *SMALL]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train_args = ["train", *common, "--steps", "0", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
                  "--doc-log", str(log), "--resume", "auto"]  # fmt: skip
    t1 = procs.start(*train_args, name="trainer1")
    a = procs.start("produce", *common, name="producer_a")
    b = procs.start("produce", *common, name="producer_b")  # the third replica starts late (below)
    wait_until(lambda: CheckpointManager(ck).latest() is not None, 90, "a checkpoint")
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    first_session = doc_log_entries(log)[0]["batches"][0]["session"]
    os.kill(a.pid, signal.SIGSTOP)  # a cannot rejoin before the late replica has joined
    try:
        t2 = procs.start(*train_args, name="trainer2")
        c = procs.start("produce", *common, name="producer_c")
        wait_until(lambda: "the trainer assigned shards" in procs.log(c), 60, "the late replica's shards")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert t2.wait(timeout=120) == 0, procs.log(t2)[-3000:]
    text = procs.log(t2)
    assert "(end of data)" in text and text.count("joined from") == 3
    assert re.search(r"producer p2 joined from .*: holds shards \d", text), "the woken replica got shards"
    assert all(p.wait(timeout=15) == 0 for p in (a, b, c))
    entries = doc_log_entries(log)
    assert_exactly_once(trained_pieces(entries, first_session, resumed_step(text)), builtin_lengths(tok, 240))


def _final_state(ck: Path) -> dict:
    latest = CheckpointManager(ck).latest()
    return torch.load(latest / "state.pt", weights_only=True)


def test_resume_equals_an_uninterrupted_run_bitwise(procs, tmp_path, port):
    """1 producer (a deterministic batch order), fp32 on CPU, 1 thread: resume must be bitwise exact."""
    common = [
        "run",
        "--port",
        str(port),
        "--producers",
        "1",
        "--threads",
        "1",
        "--lr-decay-steps",
        "24",
        *SMALL,
    ]
    a = procs.start(*common, "--steps", "24", "--checkpoint-dir", str(tmp_path / "a"), name="a")
    assert a.wait(timeout=120) == 0, procs.log(a)
    b1 = procs.start(*common, "--steps", "12", "--checkpoint-dir", str(tmp_path / "b"), name="b1")
    assert b1.wait(timeout=120) == 0, procs.log(b1)
    b2 = procs.start(
        *common, "--steps", "24", "--checkpoint-dir", str(tmp_path / "b"), "--resume", "auto", name="b2"
    )
    assert b2.wait(timeout=120) == 0, procs.log(b2)
    assert "resumed from" in procs.log(b2)
    # the summary counts this run's steps, not the checkpoint's too ("24 steps in" before)
    assert "summary: 12 steps (steps 13-24: resumed at 12) in" in procs.log(b2), procs.log(b2)
    assert "summary: 24 steps in" in procs.log(a)
    sa, sb = _final_state(tmp_path / "a"), _final_state(tmp_path / "b")
    assert sa["step"] == sb["step"] == 24
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        assert torch.equal(pa["exp_avg"], pb["exp_avg"]) and torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
    assert sa["workers"] == sb["workers"]


def _tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_mismatched_checkpoints_are_refused_and_left_alone(procs, tmp_path, port):
    ck = tmp_path / "ck"
    base = ["--port", str(port), "--producers", "1", *SMALL]
    r = procs.start("run", *base, "--steps", "4", "--checkpoint-dir", str(ck), name="make")
    assert r.wait(timeout=120) == 0, procs.log(r)
    step_dir = CheckpointManager(ck).latest()
    other_tok = tmp_path / "tok.json"
    from lmpipe.producer import builtin_corpus

    train_tokenizer((builtin_corpus.document(3, i) for i in range(200)), 400).save(str(other_tok))

    def refused(extra: list[str], expect: str, name: str) -> None:
        before = _tree_digest(ck)
        p = procs.start(
            "train", *base, "--steps", "8", "--checkpoint-dir", str(ck), "--resume", "auto", *extra, name=name
        )
        assert p.wait(timeout=60) == 2, procs.log(p)
        assert expect in procs.log(p), procs.log(p)
        assert _tree_digest(ck) == before, "a refused resume must not touch the checkpoints"

    # a run without --resume wrote step 1, 2, ... over them and rotated them away, without a word
    before = _tree_digest(ck)
    p = procs.start("run", *base, "--steps", "8", "--checkpoint-dir", str(ck), name="fresh")
    assert p.wait(timeout=60) == 2, procs.log(p)
    assert "holds an earlier run's checkpoints (the latest at step 4)" in procs.log(p), procs.log(p)
    assert "--resume auto" in procs.log(p) and _tree_digest(ck) == before

    refused(["--model", "small"], "model.n_layer: checkpoint has 2, this run has 6", "dims")
    refused(["--tokenizer", str(other_tok)], "tokenizer: checkpoint has", "tok")
    refused(["--seq-len", "32"], "stream.seq_len: checkpoint has 64, this run has 32", "seqlen")
    # it stopped at once, trained nothing and exited 0 before
    refused(["--steps", "4"], "is at step 4, at or past --steps 4: nothing to train; raise --steps", "done")

    header = step_dir / "header.json"
    good = header.read_text()
    header.write_text(json.dumps({**json.loads(good), "format_version": 99}))
    refused([], "format_version 99 is newer than this lmpipe", "future")
    header.write_text(good)

    state = step_dir / "state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    refused([], "checksum mismatch (truncated or corrupt file)", "truncated")
    state.write_bytes(data)
    header.write_text("{ not json")
    refused([], "unreadable header", "badheader")


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


def test_producer_refuses_shards_from_another_tokenizer(procs, tmp_path, port, tok):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(f"paragraph {i}" for i in range(50)))
    prepare(DocStream(Corpus([str(src)]), tok, shuffle_window=0), tmp_path / "sh", progress=False)
    other = tmp_path / "tok.json"
    train_tokenizer([f"paragraph {i}" for i in range(50)], 300).save(str(other))
    p = procs.start(
        "produce", "--data", str(tmp_path / "sh"), "--tokenizer", str(other), "--port", str(port), name="p"
    )
    assert p.wait(timeout=60) == 2
    assert "was prepared with tokenizer" in procs.log(p)
    # `lmpipe run` says so in its checks: one line, before a producer is started or the trainer built
    r = procs.start(
        "run", "--data", str(tmp_path / "sh"), "--tokenizer", str(other), "--port", str(port), name="run"
    )
    assert r.wait(timeout=60) == 2
    text = procs.log(r)
    assert (
        "was prepared with tokenizer" in text and len(text.splitlines()) == 1 and "[producer" not in text
    ), text


def test_ranks_and_workers_partition_the_corpus(tok):
    corpus = Corpus(builtin_docs=500)
    seen = []
    for rank in range(3):
        for w in range(2):
            seen += [d.doc_id for d in DocStream(corpus, tok, w, 2, rank=rank, world_size=3).docs(0)]
    assert sorted(seen) == list(range(500))


def test_two_epochs_see_every_document_twice_in_new_orders(procs, tmp_path, port, tok):
    log = tmp_path / "docs.jsonl"
    p = procs.start(
        "run", "--port", str(port), "--epochs", "2", "--steps", "0", "--doc-log", str(log), *SMALL, name="run"
    )
    assert p.wait(timeout=120) == 0, procs.log(p)
    entries = doc_log_entries(log)
    counts: dict[int, int] = {}
    for e in entries:
        for b in e["batches"]:
            for did, start, _ in b["docs"]:
                if start == 0:
                    counts[did] = counts.get(did, 0) + 1
    assert set(counts) == set(range(240)) and set(counts.values()) == {2}


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


def test_one_run_at_a_time_writes_a_checkpoint_folder(procs, tmp_path, port):
    """Two runs on one --checkpoint-dir wrote step-N over each other's, and one's clean-up removed the
    other's half-written checkpoint ("could not write checkpoint ... No such file or directory")."""
    ck = tmp_path / "ck"
    first = procs.start("run", "--port", str(port), "--producers", "1", *SMALL, "--steps", "0", "--checkpoint-dir",
                        str(ck), "--checkpoint-every", "1", name="first")  # fmt: skip
    wait_until(lambda: CheckpointManager(ck).latest() is not None, 90, "the first run's checkpoint")
    second = procs.start("run", "--port", str(port + 10), "--producers", "1", *SMALL, "--steps", "4",
                         "--checkpoint-dir", str(ck), "--resume", "auto", name="second")  # fmt: skip
    assert second.wait(timeout=60) == 2, procs.log(second)
    lines = procs.log(second).strip().splitlines()
    assert len(lines) == 1 and f"--checkpoint-dir {ck} is in use by another run" in lines[0], lines
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=60) == 0, procs.log(first)
    steps = str(CheckpointManager(ck).latest_step() + 2)
    after = procs.start("run", "--port", str(port + 10), "--producers", "1", *SMALL, "--steps", steps,
                        "--checkpoint-dir", str(ck), "--resume", "auto", name="after")  # fmt: skip
    assert after.wait(timeout=120) == 0, procs.log(after)  # the lock went with the first run


def test_a_resume_whose_schedule_differs_says_the_learning_rate_jumps(procs, tmp_path, port):
    """Resumed with a larger --steps, the cosine restarted over the new horizon (the rate from 3.0e-4 back up
    to 2.1e-3) without a word; the README's own 300 -> 600 example does it."""
    base = [
        "--port",
        str(port),
        "--producers",
        "1",
        *SMALL,
        "--warmup",
        "1",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    for steps, more, jumps in (("4", [], None), ("8", [], True), ("12", ["--lr-decay-steps", "8"], False)):
        p = procs.start("run", *base, "--steps", steps, *more, *(["--resume", "auto"] if jumps is not None else []),
                        name=f"to-{steps}")  # fmt: skip
        assert p.wait(timeout=120) == 0, procs.log(p)
        assert ("the learning rate jumps" in procs.log(p)) == bool(jumps), procs.log(p)
        if jumps:
            assert "the checkpoint's step 4 trained at" in procs.log(p), procs.log(p)


def test_a_run_that_will_save_nothing_says_so_at_its_start(procs, tmp_path, port):
    """--resume PATH or --checkpoint-every without --checkpoint-dir trained and saved nothing, without a word."""
    base = ["--port", str(port), "--producers", "1", *SMALL, "--steps", "2"]
    r = procs.start("run", *base, "--checkpoint-dir", str(tmp_path / "ck"), name="make")
    assert r.wait(timeout=120) == 0, procs.log(r)
    for given in (
        ["--resume", str(tmp_path / "ck" / "step-00000002"), "--steps", "3"],
        ["--checkpoint-every", "1"],
    ):
        p = procs.start("run", *base, *given, name="unsaved")
        assert p.wait(timeout=120) == 0, procs.log(p)
        assert f"{given[0]} {given[1]} without --checkpoint-dir: this run writes no checkpoint" in procs.log(
            p
        )
    assert sorted(x.name for x in (tmp_path / "ck").iterdir()) == [".lock", "latest", "step-00000002"]


def test_a_resume_on_another_corpus_is_refused_before_anything_starts(procs, tmp_path, port):
    """It failed after the model was built and the producers started, exit 1, with the checkpoint's corpus
    shown as the trainer's own."""
    from lmpipe.producer import builtin_corpus

    a, b, ck = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "ck"
    a.write_text("\n\n".join(builtin_corpus.document(1, i) for i in range(200)))
    b.write_text("\n\n".join(builtin_corpus.document(2, i) for i in range(200)))
    base = ["--port", str(port), "--producers", "1", *SMALL, "--checkpoint-dir", str(ck)]
    r = procs.start("run", *base, "--data", str(a), "--steps", "4", name="make")
    assert r.wait(timeout=120) == 0, procs.log(r)
    before = _tree_digest(ck)
    p = procs.start("run", *base, "--data", str(b), "--steps", "8", "--resume", "auto", name="other")
    assert p.wait(timeout=60) == 2, procs.log(p)
    lines = procs.log(p).strip().splitlines()
    assert (
        len(lines) == 1
        and "was trained on other --data (trained on, not in --data now: 'a.txt:" in lines[0]
        and "resume with the same --data" in lines[0]
    )
    # the same files with another --doc-split: that is what differs, not --data
    split = procs.start("run", *base, "--data", str(a), "--doc-split", "line", "--steps", "8", "--resume", "auto",
                        name="split")  # fmt: skip
    assert split.wait(timeout=60) == 2, procs.log(split)
    lines = procs.log(split).strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "was trained with --doc-split blank, this run has --doc-split line: resume with the same --doc-split"
    )
    assert _tree_digest(ck) == before
    # another --max-line-bytes: other lines kept, other documents under the same cursors
    lines_cut = procs.start("run", *base, "--data", str(a), "--max-line-bytes", "300", "--steps", "8", "--resume",
                            "auto", name="lines")  # fmt: skip
    assert lines_cut.wait(timeout=60) == 2, procs.log(lines_cut)
    lines = procs.log(lines_cut).strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "this run has --max-line-bytes 300: resume with the same --max-line-bytes"
    ), lines
    assert _tree_digest(ck) == before
    same = procs.start("run", *base, "--data", str(a), "--steps", "8", "--resume", "auto", name="same")
    assert same.wait(timeout=120) == 0, procs.log(same)


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
