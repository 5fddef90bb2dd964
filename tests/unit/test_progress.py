"""Progress where work is long: the trainer's live line (elapsed time, ETA), a compiling trainer that says
so, and `lmpipe tokenizer train`'s progress on a terminal (a pseudo-terminal here) and in a log."""

from __future__ import annotations

import io
import os
import re
import select

from lmpipe.consumer.report import duration, print_status
from lmpipe.progress import Progress

STATS = {"loss": 3.5, "lr": 1e-3, "tokens_per_second": 1000.0, "data_wait": 0.01, "padding_efficiency": 1.0}


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0.2, 59.4, 60, 185, 3599, 3600, 7322)] == [
        "0s", "59s", "1m00s", "3m05s", "59m59s", "1h00m", "2h02m",
    ]  # fmt: skip


def test_the_live_line_has_elapsed_time_and_an_eta_when_the_step_limit_is_known():
    out = io.StringIO()
    print_status(100, {**STATS, "elapsed": 125.0, "step_seconds": 4.5}, 300, stream=out)
    assert out.getvalue().endswith("| 2m05s, ETA 15m00s\n"), out.getvalue()  # 200 steps left at 4.5 s
    out = io.StringIO()
    print_status(100, {**STATS, "elapsed": 125.0, "step_seconds": 4.5}, 0, stream=out)  # until the data ends
    assert out.getvalue().endswith("| 2m05s\n") and "ETA" not in out.getvalue()
    out = io.StringIO()
    print_status(300, {**STATS, "elapsed": 900.0, "step_seconds": 4.5}, 300, stream=out)
    assert "ETA" not in out.getvalue(), "done: nothing left"


def test_progress_in_a_log_is_a_line_at_a_time_with_a_percentage_and_an_eta():
    out = io.StringIO()
    p = Progress("reading", 1000, every=0, stream=out)
    for _ in p.texts(["x" * 250, "é" * 125], then="learning the merges"):  # 250 bytes each (é: 2 in UTF-8)
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue(), lines
    assert re.match(r"reading: 1 documents, 0\.0 MB of 0\.0 MB \(25%\), .* elapsed(, ETA \d+s)?$", lines[0])
    assert "2 documents" in lines[1] and "(50%)" in lines[1]
    assert lines[2].endswith("; learning the merges") and "ETA" not in lines[2]


def test_progress_on_a_terminal_rewrites_one_line():
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            p = Progress("reading", 100, stream=tty)
            assert p.tty and p.every < 1
            p.every = 0
            p.update(1, 40)
            p.done("learning the merges")
        text = ""
        while "merges" not in text and select.select([master], [], [], 5)[0]:
            text += os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert text.startswith("\r\x1b[Kreading: 1 documents") and "(40%)" in text
    assert text.count("\r\x1b[K") == 2 and text.rstrip().endswith("learning the merges"), repr(text)


def test_only_the_last_line_says_100_percent_and_it_counts_the_whole_total():
    out = io.StringIO()
    p = Progress("tokenizing", 1000, unit="records", every=0, stream=out)
    p.update(1, 600)
    p.update(1, 397)  # the text of the records: short of the file by the newlines between them
    p.update(1, 3)  # every byte counted, but the pass is not over until done says so
    p.done()
    lines = out.getvalue().splitlines()
    assert [re.search(r"\((\d+)%\)", ln)[1] for ln in lines] == ["60", "99", "99", "100"], lines
    assert lines[-1].startswith("tokenizing: 3 records, 0.0 MB of 0.0 MB (100%)") and "ETA" not in lines[-1]
    out = io.StringIO()
    p = Progress("tokenizing", 1000, every=60, stream=out)
    p.update(1, 970)
    p.done()
    assert p.bytes == 1000 and out.getvalue().count("(100%)") == 1 and len(out.getvalue().splitlines()) == 1
