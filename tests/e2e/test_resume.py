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

import pytest
import torch

from lmpipe.consumer.checkpoint import CheckpointManager
from lmpipe.producer.shards import prepare
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.tokenizer import train_tokenizer
from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    small_run,
    steps_logged,
    trained_pieces,
    wait_until,
)

pytestmark = pytest.mark.slow
SMALL = small_run(None, builtin_docs=240, seq_len=64, batch_size=4, bucket_window=32)


def resumed_step(text: str) -> int:
    return int(text.split("resumed from ")[1].split(": step ")[1].split(",")[0])


# One kill a strategy (a kill point of its own for each, 6 to 25): a second seed of the same strategy ran the
# same three processes to check the same property at another step.
@pytest.mark.parametrize("strategy", ["pack", "pad", "pad-batch", "bucket"])
def test_kill_trainer_at_a_random_step(procs, tmp_path, port, tok, strategy):
    common = ["--port", str(port), "--strategy", strategy, "--epochs", "1", "--producers", "2", *SMALL]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train_args = ["train", *common, "--steps", "0", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
                  "--doc-log", str(log), "--resume", "auto", "--log-every", "5"]  # fmt: skip
    t1 = procs.start(*train_args, name="trainer1")
    for w in range(2):
        procs.start("produce", *common, "--worker", str(w), name=f"producer{w}")
    kill_at = random.Random(100 + len(strategy)).randint(6, 25)
    wait_until(lambda: steps_logged(log) >= kill_at, 90, f"step {kill_at}")
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    first = doc_log_entries(log)
    first_session = first[0]["batches"][0]["session"]
    t2 = procs.start(*train_args, name="trainer2")
    assert t2.wait(timeout=120) == 0, procs.log(t2)
    text = procs.log(t2)
    s = resumed_step(text)
    assert 4 <= s <= len(first) and s % 4 == 0  # the last checkpoint before the kill
    said = [line for line in text.splitlines() if line.split("] ", 1)[-1].startswith("summary: ")]
    assert len(said) == 1 and f": resumed at {s}) in " in said[0] and "(end of data)" in said[0], said
    entries = doc_log_entries(log)
    assert_exactly_once(trained_pieces(entries, first_session, s), builtin_lengths(tok, 240))
    # the batches lost with the killed trainer came back identical
    key = lambda b: (b["shard"], b["seq"])  # noqa: E731
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
        r"producer #\d+ joined from .*\(from producer [01]\)", text
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
    assert re.search(r"producer #2 joined from .*: holds shards \d", text), "the woken replica got shards"
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


def test_mismatched_checkpoints_are_refused_and_left_alone(procs, tmp_path, port, lmpipe_cli):
    ck = tmp_path / "ck"
    base = ["--port", str(port), "--producers", "1", *SMALL]
    r = procs.start("run", *base, "--steps", "4", "--checkpoint-dir", str(ck), name="make")
    assert r.wait(timeout=120) == 0, procs.log(r)
    step_dir = CheckpointManager(ck).latest()
    other_tok = tmp_path / "tok.json"
    from lmpipe.producer import builtin_corpus

    train_tokenizer((builtin_corpus.document(3, i) for i in range(200)), 400).save(str(other_tok))

    def refused(extra: list[str], expect: str, name: str) -> None:
        """A trainer refuses to resume, before it binds a socket: run in this process (`name` says which
        case), not as a process of its own (4 CPU-seconds of imports apiece)."""
        before = _tree_digest(ck)
        r = lmpipe_cli(
            "train", *base, "--steps", "8", "--checkpoint-dir", str(ck), "--resume", "auto", *extra
        )
        assert r.returncode == 2, (name, r.stderr)
        assert expect in r.stderr, (name, r.stderr)
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
