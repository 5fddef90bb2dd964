"""End to end with real processes and real sockets: `lmpipe run`, `lmpipe train` + `lmpipe produce`."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from lmpipe.producer import builtin_corpus
from lmpipe.shared.tokenizer import train_tokenizer
from tests.helpers import (
    GARBAGE,
    assert_exactly_once,
    builtin_lengths,
    push_garbage,
    read_doc_log,
    small_run,
    write_bad_corpus,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy,docs", [("pack", 1500), ("pad", 300), ("pad-batch", 300), ("bucket", 300)])
def test_run_trains_every_document_exactly_once(procs, tmp_path, port, tok, strategy, docs):
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", *small_run(port, strategy=strategy, builtin_docs=docs, epochs=1, steps=0, bucket_window=64,
                          log_every=5, doc_log=log, summary_json=summary, threads=1),
        name="run",
    )  # fmt: skip
    assert p.wait(timeout=180) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data"
    assert out["rejected"] == 0 and out["stale"] == 0
    # steady state excludes the first interval (compilation, warm-up); time to first step stands apart
    assert out["time_to_first_step"] > 0 and 0 < out["steady_tokens"] < out["tokens"]
    assert 0 < out["steady_seconds"] < out["seconds"]
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, docs))
    if strategy == "pack":
        assert out["padding_efficiency"] > 0.99
        assert out["first_loss"] - out["last_loss"] > 1.5, "the model learns"
    text = procs.log(p)
    said = [line for line in text.splitlines() if line.split("] ", 1)[-1].startswith("summary: ")]
    assert len(said) == 1 and "(end of data)" in said[0], said  # the summary line is the JSON's run
    assert f"{out['tokens']:,} tokens trained" in said[0] and f"{out['steps']} steps in" in said[0], said
    assert "all 16 shards finished their data" in text


def test_producer_started_first_waits_for_the_trainer(procs, tmp_path, port):
    common = small_run(port, producers=1, builtin_docs=200)
    prod = procs.start("produce", *common, name="producer")
    procs.wait_for(prod, "waiting for the trainer")
    time.sleep(1.5)
    assert prod.poll() is None
    train = procs.start("train", *common, "--steps", "5", "--log-every", "1", name="trainer")
    assert train.wait(timeout=120) == 0, procs.log(train)
    assert "step 5/5" in procs.log(train)
    assert prod.wait(timeout=10) == 0, "the trainer's stop reached the producer"
    assert "trainer says stop" in procs.log(prod)


def test_a_diverged_run_stops_loudly_and_checkpoints_nothing_of_it(procs, tmp_path, port):
    """It showed `loss n/a`, summed up the last finite loss, exited 0 and checkpointed NaN weights."""
    ck, summary = tmp_path / "ck", tmp_path / "summary.json"
    p = procs.start("run", *small_run(port, producers=1, builtin_docs=200, steps=20, lr="1e6", warmup=0, log_every=5,
                                      checkpoint_dir=ck, checkpoint_every=5, summary_json=summary),
                    name="diverged")  # fmt: skip
    assert p.wait(timeout=120) == 2, procs.log(p)
    text = procs.log(p)
    said = [line for line in text.splitlines() if "training diverged" in line]
    assert len(said) == 2, text  # the trainer's line, and the producer told why it stops
    assert any(re.search(r"\[trainer\] training diverged: the loss over steps 1-5 is -?(nan|inf) \(not finite\); stopping", x)
               for x in said), text  # fmt: skip
    assert any("trainer says stop: training diverged" in x for x in said), text
    assert "Traceback" not in text and not list(ck.glob("step-*")) and not summary.exists()


def test_mismatched_tokenizer_is_refused_on_both_sides(procs, tmp_path, port):
    other = tmp_path / "other.json"
    train_tokenizer((builtin_corpus.document(7, i) for i in range(300)), 500).save(str(other))
    common = small_run(port, producers=1)
    train = procs.start("train", *common, "--steps", "5", name="trainer")
    prod = procs.start("produce", *common, "--tokenizer", str(other), name="producer")
    assert prod.wait(timeout=60) == 2
    assert "trainer refused this producer: config mismatch: " in procs.log(prod)
    assert "tokenizer: producer has" in procs.log(prod)
    procs.wait_for(train, "refused producer")
    assert "tokenizer: producer has" in procs.log(train)
    assert train.poll() is None, "a refused producer does not take the trainer down"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_run_without_an_end_says_so_and_a_signal_stops_every_process_quickly(procs, port, sig):
    p = procs.start("run", *small_run(port, steps=0, log_every=5), name="run")
    procs.wait_for(p, "this run trains until it is stopped (Ctrl-C or SIGTERM)")
    procs.wait_for(p, "step 10")
    children = [int(pid) for pid in procs.log(p).split("pids ")[1].split("\n")[0].split()]
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C reaches the whole foreground group
    else:
        p.send_signal(sig)  # SIGTERM to the launcher alone
    assert p.wait(timeout=15) == 0, procs.log(p)
    assert time.monotonic() - t0 < 8
    time.sleep(0.5)
    for pid in children:
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text().lower(), f"orphan producer {pid}"
    said = [line for line in procs.log(p).splitlines() if line.split("] ", 1)[-1].startswith("summary: ")]
    assert len(said) == 1 and f"({sig.name})" in said[0], said  # stopped by that signal, and said so


def test_run_stops_loudly_when_its_producer_is_killed(procs, port):
    """`lmpipe run`'s producers are processes it forked: one killed by a signal is named with its exit
    status and the run fails, instead of waiting for data that cannot come."""
    p = procs.start(
        "run", *small_run(port, steps=0, producers=1, log_every=5), name="run",
    )  # fmt: skip
    procs.wait_for(p, "step 10")
    pid = int(procs.log(p).split("pids ")[1].split("\n")[0].split()[0])
    os.kill(pid, signal.SIGKILL)
    assert procs.wait(p, timeout=60) == 1, procs.log(p)
    assert "producer 0 exited with code -9" in procs.log(p)
    assert "producer exit codes: [-9]" in procs.log(p)


def test_a_dead_producer_stops_the_run_while_another_keeps_it_fed(procs, port):
    """The trainer asked about its producers only while it waited for data: with another producer keeping
    the queue full (a trainer slower than its producers), one that stopped (a changed corpus file, exit 2)
    went unnoticed while its shards moved. Now the run stops within a step."""
    p = procs.start(
        "run", *small_run(port, steps=400, producers=2, model="small", seq_len=256, batch_size=8, log_every=1),
        name="run",
    )  # fmt: skip
    procs.wait_for(p, "step 3/", timeout=120)
    pid = int(procs.log(p).split("pids ")[1].split()[0])
    os.kill(pid, signal.SIGKILL)
    assert procs.wait(p, timeout=120) == 1, procs.log(p)[-2000:]
    text = procs.log(p)
    assert "producer 0 exited with code -9" in text
    last = max(int(m) for m in re.findall(r"^step (\d+)/400", text, re.M))
    assert last < 30, f"trained on to step {last} after its producer died"


def test_bad_corpus_records_are_skipped_and_the_run_goes_on(procs, tmp_path, port):
    txt, jl = write_bad_corpus(tmp_path)
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--data", str(txt), str(jl),
        *small_run(port, epochs=1, steps=0, seq_len=16, batch_size=2, summary_json=summary), name="run",
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    text = procs.log(p)
    assert f"{txt}:4: invalid UTF-8" in text and f"{jl}:2: not valid JSON" in text
    assert "line_too_long" in text
    out = json.loads(summary.read_text())
    assert out["tokens"] > 0
    # the 8 of tests/unit/test_sources.py, each counted by the one producer that read it, in the summary too
    assert out["skipped"] == {"bad_ids": 1, "bad_json": 2, "empty": 1, "invalid_utf8": 2, "line_too_long": 1,
                              "missing_text": 1}  # fmt: skip
    assert "bad input skipped: 8 (1 bad_ids, 2 bad_json, 1 empty, 2 invalid_utf8, 1 line_too_long, " in text
    # each of the 2 producers' own figure says whose it is: a shard read by both (given away when the second
    # joined) counts in each, and the run's count is the trainer's summary above
    said = [
        line for line in text.splitlines() if "[producer" in line and "finished" in line and "bad" in line
    ]
    assert said and all(
        "; this producer skipped " in line and "in the shards it read" in line for line in said
    )
    assert "bad records skipped" not in text, "worded as the corpus's count"


def test_many_shards_with_many_kinds_of_bad_input_are_all_counted(procs, tmp_path, port):
    """128 shards x 4 kinds of bad input: one producer's counts, 512 of them, went in one hello and got it
    refused (msgpack maps hold 256 at most) mid-run. They now go 128 a heartbeat."""
    corpus = tmp_path / "mix.jsonl"
    kinds = [b'{"text": "good document %d"}\n', b'{"text": "broken\n', b'{"text": "   "}\n',
             b'{"nottext": 1}\n', b'{"text": "\xff\xfe"}\n']  # fmt: skip
    corpus.write_bytes(b"".join(kinds[i % 5] % i if i % 5 == 0 else kinds[i % 5] for i in range(5 * 2048)))
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--data", str(corpus), *small_run(port, shards=128, producers=1, epochs=1, steps=0, seq_len=32,
                                                 batch_size=4, summary_json=summary), name="run",
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)[-2000:]
    out = json.loads(summary.read_text())
    assert out["skipped"] == {"bad_json": 2048, "empty": 2048, "missing_text": 2048, "invalid_utf8": 2048}


def test_a_folder_of_1200_files_trains(procs, tmp_path, port):
    """The producers' hello carried every file's name and size, and a folder of a few hundred files made it
    too big: both producers were refused before the first step."""
    data = tmp_path / "many"
    data.mkdir()
    for i in range(1200):
        (data / f"c4-train.{i:05d}-of-01200.json.txt").write_text(f"tiny file {i} says hello\n")
    summary = tmp_path / "s.json"
    p = procs.start("run", "--data", str(data), *small_run(port, epochs=1, steps=0, summary_json=summary),
                    name="run")  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)[-2000:]
    assert json.loads(summary.read_text())["stopped_by"] == "end of data"


def test_a_producer_whose_shards_own_no_documents_says_so_not_that_it_finished_0_epochs(
    procs, tmp_path, port
):
    one = tmp_path / "one.txt"
    one.write_text("a single document, no blank line in it, " * 50 + "\n")
    p = procs.start("run", "--data", str(one), *small_run(port, producers=2, steps=20, seq_len=32, batch_size=2),
                    name="run")  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)[-2000:]
    text = procs.log(p)
    assert "finished (its shards own no documents) on shard(s)" in text
    assert "finished its 0 epoch(s)" not in text


def test_hostile_messages_are_counted_and_training_goes_on(procs, tmp_path, port):
    summary = tmp_path / "s.json"
    common = small_run(port, producers=1, builtin_docs=300, epochs=1)
    train = procs.start("train", *common, "--steps", "0", "--summary-json", str(summary), "--log-every", "2",
                        name="trainer")  # fmt: skip
    procs.wait_for(train, "listening on")
    push_garbage(port, GARBAGE)
    prod = procs.start("produce", *common, name="producer")
    assert train.wait(timeout=120) == 0, procs.log(train)
    out = json.loads(summary.read_text())
    assert out["rejected"] == len(GARBAGE)
    assert out["stopped_by"] == "end of data" and out["tokens"] > 0
    assert prod.wait(timeout=10) == 0


def test_a_run_too_short_for_a_steady_state_reports_none(procs, tmp_path, port):
    """Every step in the first logging interval: its tokens/s are start-up, so no steady figure (null in
    the JSON), not 0 tok/s and not the overall rate passed off as steady."""
    summary = tmp_path / "s.json"
    p = procs.start("run", *small_run(port, steps=4, log_every=10, summary_json=summary), name="run")
    assert p.wait(timeout=120) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["steps"] == 4 and out["tokens"] > 0
    assert out["steady_tokens_per_second"] is None and out["steady_mfu"] is None
    assert "no steady tok/s (no step after the first --log-every interval)" in procs.log(p)
    assert " 0 tok/s" not in procs.log(p)
    assert "data: the built-in corpus (20,000 generated documents)" in procs.log(p)


def test_a_trainer_stopped_before_its_first_step_says_so(procs, tmp_path, port):
    summary = tmp_path / "s.json"
    train = procs.start("train", *small_run(port, steps=5, summary_json=summary), name="trainer")
    procs.wait_for(train, "listening on")
    train.send_signal(signal.SIGTERM)
    assert procs.wait(train, timeout=60) == 0, procs.log(train)
    text = procs.log(train)
    assert "summary: no steps trained in" in text and "nan" not in text, text

    def no_nan(name: str):
        raise AssertionError(f"{name} in --summary-json: not standard JSON")

    out = json.loads(summary.read_text(), parse_constant=no_nan)  # NaN was written bare before
    assert out["steps"] == 0 and out["first_loss"] is None and out["time_to_first_step"] is None
    assert out["seconds"] > 0  # the wait it was stopped in (0.0 before)


def test_wait_timeout_is_kept_to_the_second(procs, tmp_path, port):
    """--wait-timeout 1 stopped after 10 s: the check ran only with the every-10-s 'waiting' line. A stop on
    a problem exits 1 (it exited 0, as a run that reached its end does)."""
    train = procs.start("train", *small_run(port, steps=5, wait_timeout=1), name="trainer")
    assert train.wait(timeout=60) == 1, procs.log(train)
    found = re.search(r"no data for (\d+) s \(--wait-timeout 1\)", procs.log(train))
    assert found and int(found.group(1)) < 5, procs.log(train)
