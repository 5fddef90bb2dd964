"""Never hang, never loop, never traceback (issue 8), with real processes and real sockets.

Short documents train to the end of an epoch exactly once; junk data ends with one clear line; a batch the
trainer rejects every time stops that producer and then the run; producers beyond the shards stand by; a
fuzzed control channel leaves the handshake alive; a stalled trainer shows as backpressure while it lasts,
and a restarted one is not flooded with the old session's batches. Whatever a peer packs into a control
message decodes to a well-typed message or is rejected.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import endpoints
from lmpipe.shared.wire import STRATEGIES, WIRE_VERSION
from tests.control_maps import control_maps
from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    free_ports,
    lmpipe_env,
    read_doc_log,
    short_texts,
    steps_logged,
    wait_until,
)


def text_lengths(tok, texts: list[str]) -> dict[int, int]:
    encs = tok.tokenizer.encode_batch(texts, add_special_tokens=False)
    return {i: len(e.ids) + 1 for i, e in enumerate(encs)}  # + end-of-text


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def start_python(procs, code: str, *args: str, name: str) -> subprocess.Popen:
    """A real lmpipe process with `code` run first (to give it a fault a test needs)."""
    log = open(procs.tmp / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=log, stderr=subprocess.STDOUT, env=lmpipe_env(),
        cwd=REPO, start_new_session=True,
    )  # fmt: skip
    p.log_path = procs.tmp / f"{name}.log"  # type: ignore[attr-defined]
    procs.procs.append(p)
    return p


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,split", [*((s, "line") for s in STRATEGIES), ("pack", "blank"), ("bucket", "blank")]
)
def test_short_documents_train_to_the_end_of_an_epoch_exactly_once(
    procs, tmp_path, port, tok, strategy, split
):
    """At T=32, B=8 a packed batch holds ~60 of these documents, more than max(B, T): every batch was
    rejected and replayed forever."""
    texts = short_texts(300, seed=len(strategy))
    corpus = tmp_path / "short.txt"
    corpus.write_text(("\n" if split == "line" else "\n\n").join(texts) + "\n")
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", str(corpus), "--doc-split", split, "--strategy", strategy, "--epochs", "1",
        "--steps", "0", "--seq-len", "32", "--batch-size", "8", "--bucket-window", "64", "--port", str(port),
        "--metrics-port", "-1", "--log-every", "50", "--doc-log", str(log), "--summary-json", str(summary),
        "--threads", "1", "--shards", "2", name="run",  # 150 documents a shard: full packed batches
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0, out
    assert_exactly_once(read_doc_log(log), text_lengths(tok, texts))
    if strategy == "pack":
        most = max(
            len(b["docs"]) for line in log.read_text().splitlines() for b in json.loads(line)["batches"]
        )
        assert most > 32, "batches held more pieces than the old bound allowed"
    assert "asking it to resend" not in procs.log(p)


@pytest.mark.slow
@pytest.mark.parametrize("junk", ["nul bytes", "invalid utf-8"])
def test_a_junk_corpus_ends_with_a_clear_message_and_a_nonzero_exit(procs, tmp_path, port, junk):
    path = tmp_path / "junk.dat"
    rng = random.Random(0)
    if junk == "nul bytes":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(20_000)))
    else:  # no NUL, but not one line of it decodes: every record is skipped
        path.write_bytes(b"\n".join(bytes(rng.randrange(0xC0, 0x100) for _ in range(40)) for _ in range(300)))
    p = procs.start(
        "run", "--data", str(path), "--epochs", "1", "--steps", "0", "--port", str(port), "--metrics-port",
        "-1", name="run",
    )  # fmt: skip
    rc = p.wait(timeout=90)
    text = procs.log(p)
    assert rc != 0, text
    assert "Traceback" not in text
    if junk == "nul bytes":
        assert f"{path}: binary data (a NUL byte at offset" in text
    else:  # refused before any process starts
        assert rc == 2 and f"--data: no documents in {path}" in text


@pytest.mark.slow
def test_a_batch_rejected_every_time_stops_its_producer_then_the_run(procs, tmp_path, port, tok):
    """Producer 1 has a bug: its batches' pad counts are one too many, so they are rejected whatever the
    cursor. It is stopped with the reason on both sides and its shard with it; producer 0 trains the other
    shard to the end; then no producer can make progress and the trainer exits 2 saying what to change.
    (A wire version skew no longer gets this far: the handshake refuses it, see the next test.)"""
    common = ["--port", str(port), "--producers", "2", "--builtin-docs", "60", "--epochs", "1",
              "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]  # fmt: skip
    log = tmp_path / "docs.jsonl"
    train = procs.start(
        "train",
        *common,
        "--shards",
        "2",
        "--steps",
        "0",
        "--threads",
        "1",
        "--doc-log",
        str(log),
        name="trainer",
    )
    p0 = procs.start("produce", *common, "--worker", "0", name="producer0")
    buggy = ("import sys, lmpipe.shared.batch as b; b.Batch.pad_tokens = property(lambda s: s.rows * s.width - s.real_tokens + 1); "
             "from lmpipe.cli import main; sys.exit(main())")  # fmt: skip
    p1 = start_python(procs, buggy, "produce", *common, "--worker", "1", name="producer1")
    assert p1.wait(timeout=60) == 2, procs.log(p1)
    assert "its batch seq 1 is rejected every time it is sent" in procs.log(p1)
    failed = int(re.search(r"the trainer stopped shard (\d+)", procs.log(p1)).group(1))
    assert train.wait(timeout=90) == 2, procs.log(train)
    text = procs.log(train)
    assert f"no producer can make progress: shard {failed}:" in text and "token counts do not add up" in text
    assert "same lmpipe version" in text and "Traceback" not in text
    assert text.count("asking it to resend") <= 3, "one resend, not a storm"
    assert p0.wait(timeout=10) == 0
    lengths = builtin_lengths(tok, 60)
    pieces = read_doc_log(log)
    assert_exactly_once(
        {d: v for d, v in pieces.items() if d % 2 != failed},
        {d: n for d, n in lengths.items() if d % 2 != failed},
    )
    # the stopped shard's documents: whatever producer 0 sent of it before producer 1 took it, at most once
    assert all(sum(n for _, n in v) <= lengths[d] for d, v in pieces.items() if d % 2 == failed)


@pytest.mark.slow
def test_a_producer_of_another_wire_version_is_refused_at_the_handshake(procs, tmp_path, port):
    """An older producer (wire version 2, and one whose hello names no version at all) is refused at its
    first hello, both versions named on both sides: it exits 2 with one line, before any batch reaches the
    trainer, which goes on and trains with a producer of its own version."""
    mport = free_ports(1)
    common = ["--port", str(port), "--producers", "1", "--builtin-docs", "60", "--seq-len", "64",
              "--batch-size", "4"]  # fmt: skip
    train = procs.start("train", *common, "--steps", "3", "--metrics-port", str(mport), name="trainer")
    procs.wait_for(train, "listening on")
    older = f"import sys, lmpipe.shared.wire as w; w.WIRE_VERSION = {WIRE_VERSION - 1}; from lmpipe.cli import main; sys.exit(main())"
    old = start_python(procs, older, "produce", *common, "--metrics-port", "-1", name="old")
    assert old.wait(timeout=60) == 2, procs.log(old)
    want = (f"wire version mismatch: the producer speaks wire version {WIRE_VERSION - 1}, the trainer speaks "
            f"wire version {WIRE_VERSION}; run the same lmpipe version on both sides")  # fmt: skip
    refused = [ln for ln in procs.log(old).splitlines() if "refused" in ln]
    assert len(refused) == 1 and refused[0].endswith(f"trainer refused this producer: {want}"), procs.log(old)
    assert "Traceback" not in procs.log(old) and "retry" not in procs.log(old)
    procs.wait_for(train, want)
    # one per hello refused: a producer may have sent a second (at connect, and once connected) before it
    # read the answer to its first
    refusals = metric(mport, "lmpipe_trainer_handshake_refusals_total", reason="wire_version")
    assert refusals >= 1

    # a hello without the field: a producer from before the hello carried it
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoints(PipelineConfig(port=port)).control)  # as this user: past the transport
        dealer.send(
            msgpack.packb({"type": "hello", "worker": -1, "fingerprint": {}, "pid": 1, "host": "old"})
        )
        assert dealer.poll(30_000), "the trainer answers a hello without a version"
        answer = messages.unpack(dealer.recv())
    finally:
        ctx.destroy(0)
    assert isinstance(answer, messages.Refuse), answer
    assert answer.reason.startswith("wire version mismatch: the producer speaks wire version 2 or older (its "
                                    f"hello names none), the trainer speaks wire version {WIRE_VERSION}")  # fmt: skip
    assert metric(mport, "lmpipe_trainer_handshake_refusals_total", reason="wire_version") > refusals
    assert metric(mport, "lmpipe_trainer_handshake_refusals_total", reason="config_mismatch") == 0
    assert metric(mport, "lmpipe_trainer_batches_rejected_total", reason="bad_version") == 0, "no batch came"
    assert train.poll() is None, "a refused producer does not take the trainer down"

    prod = procs.start("produce", *common, "--metrics-port", "-1", name="producer")
    assert train.wait(timeout=120) == 0, procs.log(train)
    assert prod.wait(timeout=30) == 0, procs.log(prod)
    assert "Traceback" not in procs.log(train)


@pytest.mark.slow
def test_producers_beyond_the_shards_stand_by_and_one_takes_over_when_a_holder_dies(
    procs, tmp_path, port, tok
):
    common = ["--port", str(port), "--producers", "3", "--builtin-docs", "600", "--epochs", "1",
              "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]  # fmt: skip
    log = tmp_path / "docs.jsonl"
    train = procs.start(
        "train",
        *common,
        "--shards",
        "2",
        "--steps",
        "0",
        "--threads",
        "1",
        "--doc-log",
        str(log),
        name="trainer",
    )
    ps = [procs.start("produce", *common, name=f"producer{i}") for i in range(3)]
    wait_until(lambda: procs.log(train).count("joined from") == 3, 60, "3 producers joined")
    wait_until(lambda: steps_logged(log) >= 5, 60, "step 5")
    idle = [p for p in ps if "assigned shards none (standing by)" in procs.log(p)]
    assert len(idle) == 1, [procs.log(p)[-500:] for p in ps]
    victim = next(p for p in ps if p is not idle[0])
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    procs.wait_for(idle[0], "the trainer assigned shards ", timeout=30)
    assert train.wait(timeout=120) == 0, procs.log(train)
    assert re.search(
        r"producer #\d \(\S+\) left \(connection closed\): shards \d moved \d to producer #\d",
        procs.log(train),
    ), procs.log(train)
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, 600))
    assert all(p.wait(timeout=10) == 0 for p in ps if p is not victim)


@pytest.mark.slow
def test_an_auto_and_an_explicit_worker_started_before_the_trainer_both_serve(procs, tmp_path, port, tok):
    """Issue 8's race: `produce --worker -1`, then `--worker 0` 0.3 s later, then the trainer with
    --producers 2. The auto producer took id 0 and the explicit one was refused forever; the trainer waited
    for id 1. Worker numbers now only name producers in logs: both join, and the epoch ends exactly once."""
    common = ["--port", str(port), "--producers", "2", "--builtin-docs", "200", "--epochs", "1",
              "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]  # fmt: skip
    log = tmp_path / "docs.jsonl"
    auto = procs.start("produce", *common, "--worker", "-1", name="auto")
    time.sleep(0.3)
    explicit = procs.start("produce", *common, "--worker", "0", name="explicit")
    train = procs.start(
        "train", *common, "--steps", "0", "--threads", "1", "--doc-log", str(log), name="trainer"
    )
    assert procs.wait(train, 120) == 0, procs.log(train)
    assert procs.log(train).count("joined from") == 2, procs.log(train)
    assert procs.wait(auto, 10) == 0 and procs.wait(explicit, 10) == 0
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, 200))


control_frames = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),
    st.builds(lambda m: [msgpack.packb(m, use_bin_type=True)], control_maps),
    st.builds(
        lambda w, fp: [messages.pack(messages.Hello(producer=w, fingerprint=fp, wire=WIRE_VERSION))],
        st.integers(-5, 5),
        st.dictionaries(
            st.text(max_size=10),
            st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=10)),
            max_size=5,
        ),
    ),
)


@pytest.mark.slow
def test_a_fuzzed_control_channel_leaves_the_handshake_alive(procs, tmp_path, port, tok):
    mport = free_ports(1)
    common = ["--port", str(port), "--producers", "2", "--builtin-docs", "120", "--epochs", "1",
              "--seq-len", "64", "--batch-size", "4"]  # fmt: skip
    summary, log = tmp_path / "s.json", tmp_path / "docs.jsonl"
    train = procs.start("train", *common, "--steps", "0", "--threads", "1", "--metrics-port", str(mport),
                        "--summary-json", str(summary), "--doc-log", str(log), name="trainer")  # fmt: skip
    procs.wait_for(train, "listening on")
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(3)]
    for d in dealers:
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoints(PipelineConfig(port=port)).control)  # as this user: past the transport
    sent = 0

    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frames=control_frames, which=st.integers(0, 2))
    def fuzz(frames, which):
        nonlocal sent
        dealers[which].send_multipart(frames)
        sent += 1

    try:
        fuzz()
        # the hello: a bytes key in the fingerprint
        dealers[0].send(msgpack.packb({"type": "hello", "producer": 0,
                                       "fingerprint": {b"tokenizer": "x", "vocab_size": 1}}))  # fmt: skip
        sent += 1

        def counted() -> float:
            return sum(
                metric(mport, "lmpipe_trainer_batches_rejected_total", reason=r)
                for r in ("bad_control", "bad_header", "oversized", "handshake")
            )

        wait_until(lambda: counted() >= sent, 60, "every fuzzed message counted")
        assert counted() == sent, "each message rejected and counted exactly once"
        assert metric(mport, "lmpipe_trainer_producers_connected") == 0
        # data frames over the size limit are counted too: read and rejected up to ZeroMQ's guard,
        # a disconnect beyond it
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints(PipelineConfig(port=port)).data)
        hdr = {"v": WIRE_VERSION, "kind": "end", "session": "x", "shard": 0, "seq": 1,
               "cursor": {"epoch": 0, "pos": 0, "offset": 0, "skip": 0}, "arrays": [["doc_id", "int64", [8]]]}  # fmt: skip
        push.send_multipart([msgpack.packb(hdr), b"\0" * 100_000])
        wait_until(lambda: metric(mport, "lmpipe_trainer_batches_rejected_total", reason="bad_length") == 1, 30,
                   "the oversized frame counted")  # fmt: skip
        push.send_multipart([msgpack.packb(hdr), b"\0" * (8 << 20)])
        wait_until(lambda: metric(mport, "lmpipe_trainer_data_disconnects_total") >= 1, 30, "the cut counted")

        producers = [procs.start("produce", *common, "--worker", "-1", "--metrics-port", "-1", name=f"p{i}")
                     for i in range(2)]  # fmt: skip
        wait_until(lambda: procs.log(train).count("joined from") == 2, 60, "2 producers joined")
        assert metric(mport, "lmpipe_trainer_producers_connected") == 2
        # one bad batch naming worker 0 of this session, from a peer that is not worker 0's holder (it lacks
        # the holder's lease): rejected and counted, and no resend (only the holder's own batches may
        # make it rewind), then training goes on
        wait_until(lambda: steps_logged(log) >= 2, 60, "step 2")
        session = doc_log_entries(log)[0]["batches"][0]["session"]
        bad = {**hdr, "kind": "batch", "session": session, "seq": 10_000, "strategy": "pack",
               "counts": {"tokens": 1, "pad": 0, "docs": 1}, "arrays": [["tokens", "float64", [1]]]}  # fmt: skip
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints(PipelineConfig(port=port)).data)
        push.send_multipart([msgpack.packb(bad), b"\0" * 8])
        assert train.wait(timeout=90) == 0, procs.log(train)
    finally:
        ctx.destroy(0)
    assert json.loads(summary.read_text())["stopped_by"] == "end of data"
    assert all(p.wait(timeout=10) == 0 for p in producers)
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, 120))
    text = procs.log(train)
    assert "Traceback" not in text
    assert "array 'tokens' has dtype 'float64'" in text
    assert "asking it to resend" not in text, "a batch without the holder's lease makes nobody rewind"
    assert text.count("refused producer") <= 2, "refusals of one peer are logged once a minute"


@pytest.mark.slow
def test_a_stalled_trainer_shows_live_and_a_restarted_one_gets_no_old_batches(procs, tmp_path, port, tok):
    mport = free_ports(1)
    common = ["--port", str(port), "--producers", "1", "--builtin-docs", "3000", "--epochs", "1",
              "--seq-len", "64", "--batch-size", "4"]  # fmt: skip
    log, ck, summary = tmp_path / "docs.jsonl", tmp_path / "ck", tmp_path / "s.json"

    def train_args(steps: int) -> list[str]:
        return ["train", *common, "--steps", str(steps), "--metrics-port", "-1", "--checkpoint-dir", str(ck),
                "--checkpoint-every", "4", "--resume", "auto", "--doc-log", str(log), "--threads", "1"]  # fmt: skip

    t1 = procs.start(*train_args(0), name="trainer1")
    prod = procs.start("produce", *common, "--metrics-port", str(mport), name="producer")
    wait_until(lambda: steps_logged(log) >= 6, 90, "step 6")
    os.kill(t1.pid, signal.SIGSTOP)  # a trainer that stops reading: backpressure
    try:
        time.sleep(1.5)
        before = metric(mport, "lmpipe_producer_send_blocked_seconds_total")
        time.sleep(2.0)
        during = metric(mport, "lmpipe_producer_send_blocked_seconds_total")
    finally:
        os.kill(t1.pid, signal.SIGCONT)
    assert during - before > 1.5, "the wait shows while it lasts, not only once the send goes through"
    wait_until(lambda: steps_logged(log) >= 10, 60, "step 10")
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    procs.wait_for(prod, "lost the connection to the trainer")
    # its wait is counted from the loss, not from its start: the count is the time since the "lost" line
    procs.wait_for(prod, "s since the connection dropped)")
    text = procs.log(prod)
    lost = re.search(r"(\d\d):(\d\d):(\d\d) \[producer\] lost the connection to the trainer", text)
    waited = re.search(
        r"(\d\d):(\d\d):(\d\d) \[producer\] waiting for the trainer at \S+ \((\d+) s since the conn", text
    )
    assert lost and waited, text[-2000:]
    clock = [
        int(lost[1]) * 3600 + int(lost[2]) * 60 + int(lost[3]),
        int(waited[1]) * 3600 + int(waited[2]) * 60 + int(waited[3]),
    ]
    assert abs(int(waited[4]) - (clock[1] - clock[0]) % 86400) <= 1, text[-2000:]
    time.sleep(1.0)
    first_session = doc_log_entries(log)[0]["batches"][0]["session"]
    t2 = procs.start(*train_args(24), "--summary-json", str(summary), name="trainer2")
    assert t2.wait(timeout=90) == 0, procs.log(t2)
    out = json.loads(summary.read_text())
    assert out["stale"] <= 2, f"{out['stale']} batches of the dead session reached the new trainer"
    assert "trainer restarted; rejoined" in procs.log(prod)
    sessions = [e["batches"][0]["session"] for e in doc_log_entries(log)]
    assert sessions[0] == first_session and sessions[-1] != first_session
