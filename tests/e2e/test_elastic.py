"""Elastic producers (issue 12): producers join and leave a running job, the trainer re-divides the shards,
and every document is trained exactly once per epoch, across joins, kills, a SIGTERM and a trainer restart.

The split is the trainer's --shards (record id % shards), fixed for the run and recorded in its
checkpoints; which producer serves which shard changes with every join and leave (consumer/assign.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from lmpipe.consumer.checkpoint import CheckpointManager
from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    steps_logged,
    trained_pieces,
    wait_until,
)

DOCS = 1500


def job(port: int, strategy: str) -> list[str]:
    return ["--port", str(port), "--strategy", strategy, "--epochs", "1", "--builtin-docs", str(DOCS),
            "--seq-len", "64", "--batch-size", "4", "--bucket-window", "32", "--metrics-port", "-1"]  # fmt: skip


def resumed_step(text: str) -> int:
    return int(text.split("resumed from ")[1].split(": step ")[1].split(",")[0])


def shards_of(log: str) -> list[int]:
    """The shards a producer's log says it holds now (its last assignment)."""
    got = re.findall(r"the trainer assigned shards ([\d,]+|none)", log)
    return [] if not got or got[-1] == "none" else [int(s) for s in got[-1].split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_producers_join_and_leave_mid_epoch_and_every_document_is_trained_once(
    procs, tmp_path, port, tok, strategy
):
    """2 producers, 2 more join mid-epoch, one is killed (-9), one stopped (SIGTERM), the trainer is killed
    and restarted from its checkpoint with the 2 producers left: each document's tokens exactly once."""
    common = job(port, strategy)
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train_args = ["train", *common, "--producers", "2", "--shards", "8", "--steps", "0", "--threads", "1",
                  "--checkpoint-dir", str(ck), "--checkpoint-every", "10", "--doc-log", str(log),
                  "--resume", "auto", "--log-every", "10"]  # fmt: skip
    t1 = procs.start(*train_args, name="trainer1")
    p = [procs.start("produce", *common, name=f"p{i}") for i in range(2)]
    wait_until(lambda: steps_logged(log) >= 10, 90, "step 10")
    assert [len(shards_of(procs.log(x))) for x in p] == [4, 4]

    def trainer_says(text: str, n: int = 1) -> None:
        wait_until(lambda: procs.log(t1).count(text) >= n, 60, f"{text!r} x{n} in the trainer's log")

    # two more join: each takes 2 shards from the two holding 4
    p += [procs.start("produce", *common, name=f"p{i}") for i in (2, 3)]
    trainer_says("joined from", 4)
    wait_until(lambda: all(len(shards_of(procs.log(x))) == 2 for x in p), 30, "2 shards each")
    assert sorted(s for x in p for s in shards_of(procs.log(x))) == list(range(8))
    at = steps_logged(log)
    wait_until(lambda: steps_logged(log) >= at + 10, 60, "10 steps with 4 producers")

    # one is killed: its shards go to the other three
    os.kill(p[0].pid, signal.SIGKILL)
    p[0].wait()
    trainer_says("left (connection closed)")
    wait_until(lambda: sorted(s for x in p[1:] for s in shards_of(procs.log(x))) == list(range(8)), 30,
               "the killed producer's shards spread")  # fmt: skip
    at = steps_logged(log)
    wait_until(lambda: steps_logged(log) >= at + 10, 60, "10 steps with 3 producers")

    # one is stopped: it exits 0, and the last two hold every shard
    p[2].send_signal(signal.SIGTERM)
    assert p[2].wait(timeout=30) == 0, procs.log(p[2])
    trainer_says("left (said goodbye)")  # a stop of its own, not a loss (the ProducerLost alert)
    wait_until(lambda: sorted(s for x in (p[1], p[3]) for s in shards_of(procs.log(x))) == list(range(8)), 30,
               "the stopped producer's shards spread")  # fmt: skip

    # the trainer dies after a checkpoint; its successor resumes with 2 producers where there were 4
    wait_until(lambda: CheckpointManager(ck).latest_step() is not None and CheckpointManager(ck).latest_step() > at,
               60, "a checkpoint with 3 producers or fewer")  # fmt: skip
    wait_until(lambda: steps_logged(log) >= CheckpointManager(ck).latest_step() + 3, 60, "steps after it")
    assert "all 8 shards finished" not in procs.log(t1), "the epoch is still running"
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    first_session = doc_log_entries(log)[0]["batches"][0]["session"]
    t2 = procs.start(*train_args, name="trainer2")
    assert t2.wait(timeout=180) == 0, procs.log(t2)[-3000:]
    text = procs.log(t2)
    assert "(end of data)" in text and "all 8 shards finished" in text
    assert text.count("joined from") == 2
    for x in (p[1], p[3]):
        assert x.wait(timeout=30) == 0, procs.log(x)[-2000:]
        assert "trainer restarted; rejoined" in procs.log(x)
    entries = doc_log_entries(log)
    assert_exactly_once(
        trained_pieces(entries, first_session, resumed_step(text)), builtin_lengths(tok, DOCS)
    )


@pytest.mark.slow
def test_a_resume_with_other_producers_is_exact_and_other_shards_are_refused(procs, tmp_path, port, tok):
    common = [*job(port, "pack"), "--builtin-docs", "400", "--threads", "1"]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    first = procs.start("run", *common, "--producers", "1", "--steps", "12", "--checkpoint-dir", str(ck),
                        "--doc-log", str(log), name="first")  # fmt: skip
    assert first.wait(timeout=120) == 0, procs.log(first)
    session = doc_log_entries(log)[0]["batches"][0]["session"]

    other = procs.start("run", *common, "--producers", "1", "--shards", "4", "--steps", "0", "--checkpoint-dir",
                        str(ck), "--resume", "auto", name="other_shards")  # fmt: skip
    assert other.wait(timeout=60) == 2, procs.log(other)
    assert "shards: checkpoint has 16, this run has 4" in procs.log(other)

    second = procs.start("run", *common, "--producers", "3", "--steps", "0", "--checkpoint-dir", str(ck),
                         "--resume", "auto", "--doc-log", str(log), name="second")  # fmt: skip
    assert second.wait(timeout=120) == 0, procs.log(second)
    text = procs.log(second)
    assert resumed_step(text) == 12 and text.count("joined from") == 3
    assert_exactly_once(trained_pieces(doc_log_entries(log), session, 12), builtin_lengths(tok, 400))


@pytest.mark.slow
def test_the_summarys_skipped_records_survive_a_join_and_a_kill(procs, tmp_path, port):
    """A producer reads ahead on all 8 shards, a second joins and takes 4 of them, the first is killed and
    the second takes the rest: each reads its shards again from the start, and the summary still counts
    each of the corpus's bad lines once (it added every process's count before). 4 of 5 lines are bad: the
    run is short. Bad input is counted on a stream's first pass only, so 2 epochs count it once."""
    corpus = tmp_path / "c.jsonl"
    words = " ".join(f"w{i}" for i in range(40))
    corpus.write_text("".join(f'{{"text": "{i} {words}"}}\n' if i % 5 == 0 else '{"text": "broken\n'
                              for i in range(20_000)))  # fmt: skip
    summary = tmp_path / "s.json"
    # 2 epochs: the join and the kill come within the first (a few seconds), whatever the machine's speed
    common = ["--port", str(port), "--data", str(corpus), "--epochs", "2", "--shuffle-window", "1",
              "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]  # fmt: skip
    t = procs.start("train", *common, "--producers", "1", "--shards", "8", "--steps", "0", "--threads", "1",
                    "--summary-json", str(summary), name="trainer")  # fmt: skip
    p0 = procs.start("produce", *common, name="p0")
    wait_until(lambda: "this producer skipped 100 bad records" in procs.log(p0), 60, "p0's count of 100")
    time.sleep(2)  # a heartbeat or two carry p0's counts of all 8 shards (the old sum kept them)
    p1 = procs.start("produce", *common, name="p1")
    wait_until(lambda: len(shards_of(procs.log(p1))) == 4, 60, "p1 holds 4 shards")
    os.kill(p0.pid, signal.SIGKILL)
    p0.wait()
    wait_until(lambda: len(shards_of(procs.log(p1))) == 8, 60, "p1 holds every shard")
    assert t.wait(timeout=240) == 0, procs.log(t)[-3000:]
    assert "(end of data)" in procs.log(t)
    assert json.loads(summary.read_text())["skipped"] == {"bad_json": 16_000}


@pytest.mark.slow
def test_a_later_producer_with_other_content_under_the_same_names_and_sizes_is_refused(procs, tmp_path, port):
    """The corpus check compared names and sizes only (`data`): a producer that joined later with files of
    the same names and sizes but other content (rewritten, or another host's) was accepted and served other
    text under the run's record ids. Its hello's `data_content` now differs from the first producer's: it
    is refused, the run goes on with the first producer, and a producer with the same files joins."""
    from lmpipe.producer import builtin_corpus

    ours, other, copy = tmp_path / "ours", tmp_path / "other", tmp_path / "copy"
    text = "\n\n".join(builtin_corpus.document(1, i) for i in range(300)).encode()
    changed, mid = bytearray(text), len(text) // 2
    changed[mid] = ord("x") if changed[mid] != ord("x") else ord("y")  # one byte other: the same size
    for d, body in ((ours, text), (other, bytes(changed)), (copy, text)):
        d.mkdir()
        (d / "corpus.txt").write_bytes(body)
    log = tmp_path / "docs.jsonl"
    # --epochs 0, --steps 0: the trainer runs until it is stopped, however slow the machine
    common = ["--port", str(port), "--epochs", "0", "--seq-len", "64", "--batch-size", "4", "--metrics-port",
              "-1"]  # fmt: skip
    t = procs.start("train", *common, "--producers", "1", "--shards", "4", "--steps", "0", "--threads", "1",
                    "--doc-log", str(log), name="trainer")  # fmt: skip
    p0 = procs.start("produce", *common, "--data", str(ours), name="p0")
    wait_until(lambda: steps_logged(log) >= 2, 90, "steps with the first producer")

    why = "the producer's corpus files have the same names and sizes but other content"
    late = procs.start("produce", *common, "--data", str(other), name="other")
    assert procs.wait(late, 60) == 2, procs.log(late)[-3000:]
    assert f"trainer refused this producer: config mismatch: data_content: {why}" in procs.log(late)
    procs.wait_for(t, why)
    assert t.poll() is None and p0.poll() is None, "a refused producer takes nothing down"
    assert procs.log(t).count("joined from") == 1
    at = steps_logged(log)
    wait_until(lambda: steps_logged(log) >= at + 3, 60, "steps after the refusal, with the first producer")

    same = procs.start("produce", *common, "--data", str(copy), name="same")
    wait_until(lambda: procs.log(t).count("joined from") == 2, 60, "the producer with the same files joins")
    assert why not in procs.log(same) and same.poll() is None
    t.send_signal(signal.SIGTERM)
    assert procs.wait(t, 60) == 0, procs.log(t)[-3000:]
