"""Issue 44 item 2 (trainer side): the time the trainer waits for data is counted wherever it falls.

A real trainer whose producer starts late (as one retrying a store that is down would) and is then frozen
mid-run (SIGSTOP, as a storage outage stalls it): the wait for the first batch is reported apart in the
summary and --summary-json, and the mid-run stall shows as data wait. Before, the first wait was dropped
("data wait 0.0%"; only "first step after N s" showed it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from tests.helpers import Procs, wait_until

LATE = 3.0  # seconds the producer starts after the trainer listens
FROZEN = 4.0  # seconds it is stopped mid-run: more than the few batches queued ahead take to train
COMMON = [
    "--builtin-docs",
    "400",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--epochs",
    "0",
    "--producers",
    "1",
]


def _steps(text: str) -> int:
    """The last step in the trainer's status lines ("step 12 | loss ..." or "step 12/100 | ...")."""
    return max((int(n) for n in re.findall(r"(?m)(?:^|\] )step (\d+)\b", text)), default=0)


def test_waits_before_the_first_step_and_mid_run_are_counted(procs: Procs, tmp_path: Path, port: int):
    summary = tmp_path / "summary.json"
    train = procs.start("train", *COMMON, "--port", str(port), "--steps", "0", "--log-every", "2", "--threads",
                        "1", "--metrics-port", "-1", "--summary-json", str(summary), name="trainer")  # fmt: skip
    procs.wait_for(train, "listening on", 120)
    time.sleep(LATE)
    prod = procs.start("produce", *COMMON, "--port", str(port), "--metrics-port", "-1", name="producer")
    wait_until(lambda: _steps(procs.log(train)) >= 4, 120, "4 steps")
    os.kill(prod.pid, signal.SIGSTOP)
    time.sleep(FROZEN)
    os.kill(prod.pid, signal.SIGCONT)
    at = _steps(procs.log(train))
    wait_until(lambda: _steps(procs.log(train)) >= at + 4, 120, "4 more steps")
    os.kill(train.pid, signal.SIGTERM)
    assert procs.wait(train, 120) == 0, procs.log(train)[-3000:]
    got = json.loads(summary.read_text())
    assert got["first_data_wait_seconds"] >= LATE - 0.5, got
    assert got["first_data_wait_seconds"] < got["time_to_first_step"], got
    # the frozen producer: the trainer drained what was queued, then waited for the rest of the freeze
    assert got["data_wait_seconds"] >= 1.0, got
    assert got["data_wait_fraction"] > 0, got
    line = next(ln for ln in procs.log(train).splitlines() if "summary:" in ln)
    assert "s waiting for data)" in line, line
