"""The trainer's live line (lmpipe/live.py): an ETA at the pace of the last minute (not of the last logging
interval, not counting the first step's compilation), a line cut to the terminal's width by dropping the
least useful fields, plain lines off a terminal, and lines of other processes printed above the line on a
real pseudo-terminal."""

from __future__ import annotations

import io
import os
import select
import time

from lmpipe.consumer.report import status_fields
from lmpipe.live import Eta, LiveLine, fit, plain_progress

STATS = {"loss": 3.5, "lr": 1e-3, "tokens_per_second": 123456.0, "data_wait": 0.01, "padding_efficiency": 0.97,
         "mfu": 0.41, "loss_scale": 65536.0, "elapsed": 125.0, "step_seconds": 4.5}  # fmt: skip


def test_the_eta_leaves_out_the_first_step_and_holds_through_a_stall():
    eta = Eta(total=1000)
    eta.observe(0.0, 0)
    eta.observe(90.0, 1)  # the first step: 90 s of compilation
    assert eta.left(90.0) is None, "one step is no pace"
    for s in range(2, 101):  # then one step a second
        eta.observe(90.0 + s - 1, s)
    assert abs(eta.left(189.0) - 900.0) < 1.0  # type: ignore[operator]
    # a checkpoint write: one step of 6 s; the interval's pace said 6x as long (5m11s -> 30s -> 3m12s)
    eta.observe(195.0, 101)
    assert abs(eta.left(195.0) - 899.0) / 899.0 < 0.1  # type: ignore[operator]
    assert eta.left(196.0) < eta.left(195.0), "it counts down between steps"  # type: ignore[operator]
    assert eta.left(300.0) == eta.left(199.0), "for one step's time at most: a stall is no progress"


def test_the_line_fits_the_terminal_dropping_the_least_useful_fields_first():
    fields = status_fields(400, STATS, 1000, eta=754.0, live=True)
    full = fit(fields, 500)
    assert full.startswith("step 400/1000 | loss 3.5000 | lr 1.00e-03 | 123,456 tok/s") and "pad eff" in full
    at80 = fit(fields, 79)
    assert len(at80) <= 79 and at80.startswith("step 400/1000 | loss 3.5000 |"), at80
    assert at80.endswith("| 2m05s, ETA 12m34s") and "pad eff" not in at80 and "lr " not in at80, at80
    assert fit(fields, 30) == "step 400/1000 | 2m05s, ETA 12m34s"[:30]
    # between intervals, before the first one: the step and the clock
    assert fit(status_fields(3, {"elapsed": 5.0}, 1000, eta=None, live=True), 79) == "step 3/1000 | 5s"


def test_off_a_terminal_a_line_per_interval_with_the_smoothed_eta():
    out = io.StringIO()
    progress = plain_progress(100, stream=out)
    progress(10, STATS)  # the first interval: its pace is start-up's, so no ETA
    time.sleep(0.05)
    progress(20, STATS)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("| 2m05s"), lines
    assert lines[0].startswith("step 10/100 | loss 3.5000 | lr 1.00e-03 | 123,456 tok/s | data wait 1.0%")
    assert "ETA" in lines[1] and "ETA 6m00s" not in lines[1], "not the interval's 4.5 s a step"


def test_lines_written_to_stderr_go_above_the_line_on_a_terminal():
    master, slave = os.openpty()
    r, w = os.pipe()
    live = LiveLine(100, slave, r)
    step = [7]
    live.attach(lambda: step[0])
    live.start()
    try:
        os.write(w, b"12:00:00 [producer 0] a line\n12:00:00 [producer 1] in two ")
        os.write(w, b"writes\n")
        step[0] = 8
        time.sleep(0.8)
        os.write(w, b"12:00:01 [trainer] last words\n")  # still in the pipe: finish() prints it first
        live.finish()
        os.write(w, b"after the end\n")
        os.close(w)
        live.close()
        out = _read(master)
    finally:
        for fd in (master, slave, r):
            os.close(fd)
    # every line of another process starts a line of its own; the status line is drawn after them
    rows = out.replace("\r\n", "\n").split("\n")
    lines = [row.rsplit("\r\x1b[K", 1)[-1] for row in rows]
    assert "12:00:00 [producer 0] a line" in lines and "12:00:00 [producer 1] in two writes" in lines, lines
    assert lines[-4] == "12:00:01 [trainer] last words", lines
    assert lines[-3].startswith("step 8/100 | ") and "ETA" not in lines[-3], lines  # ended, kept
    assert lines[-2:] == ["after the end", ""], lines


def _read(fd: int) -> str:
    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        data += os.read(fd, 65536)
    return data.decode()
