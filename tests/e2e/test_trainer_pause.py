"""A trainer paused past the producers' heartbeat timeout (kill -STOP, then -CONT) keeps one registration
per producer (issue 35): each producer reconnects and takes up its own shards again at once, and the
epoch is trained exactly once."""

from __future__ import annotations

import os
import re
import signal
import time

from lmpipe.shared.sockets import HEARTBEAT_TIMEOUT_MS
from tests.helpers import assert_exactly_once, builtin_lengths, read_doc_log, steps_logged, wait_until

DOCS = 1200
# past the ZMTP heartbeat timeout, so that the producers drop their control connections and reconnect
PAUSE = HEARTBEAT_TIMEOUT_MS / 1000 + 5


def test_a_paused_trainer_keeps_one_registration_per_producer(procs, tmp_path, port, tok):
    common = ["--port", str(port), "--strategy", "pack", "--epochs", "1", "--builtin-docs", str(DOCS),
              "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]  # fmt: skip
    log = tmp_path / "docs.jsonl"
    train = procs.start("train", *common, "--producers", "2", "--shards", "8", "--steps", "0", "--threads", "1",
                        "--doc-log", str(log), "--log-every", "10", name="trainer")  # fmt: skip
    producers = [procs.start("produce", *common, name=f"p{i}") for i in range(2)]
    wait_until(lambda: steps_logged(log) >= 10, 120, "step 10")
    os.kill(train.pid, signal.SIGSTOP)
    time.sleep(PAUSE)
    os.kill(train.pid, signal.SIGCONT)
    wait_until(lambda: all("lost the connection" in procs.log(p) for p in producers), 30, "both reconnected")
    assert train.wait(timeout=300) == 0, procs.log(train)[-3000:]
    text = procs.log(train)
    # each producer joined once, and at most once more if its old connection's close was seen before its
    # rejoin; none registered twice at a time (a phantom holds shards until it is "silent for" 40 s)
    joins = re.findall(r"producer #?\d+ joined from (\S+):", text)
    assert len(set(joins)) == 2 and all(joins.count(w) <= 2 for w in joins), joins
    assert "silent for" not in text and "all 8 shards finished" in text
    for p in producers:
        assert p.wait(timeout=30) == 0, procs.log(p)[-2000:]
        assert "welcomed this producer back" in procs.log(p)
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, DOCS))
