"""Corpus readers: document splitting, and bad input skipped with file:line, counted, never fatal."""

from __future__ import annotations

import json

import pytest

from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream


@pytest.mark.slow
def test_a_json_line_nested_too_deeply_is_a_bad_record_not_a_crash(procs, tmp_path, port):
    """{"a":{"a":... 50,000 deep (300 KB, under --max-line-bytes) overflowed json's recursion: the producer
    died with a traceback and took the run with it."""
    data = tmp_path / "deep.jsonl"
    deep = '{"a":' * 50_000 + "1" + "}" * 50_000
    good = [json.dumps({"text": f"document {i} " + "words " * 20}) for i in range(40)]
    data.write_text("\n".join(good[:20] + [deep, "[" * 50_000] + good[20:]) + "\n")
    summary = tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", str(data), "--epochs", "1", "--steps", "0", "--seq-len", "32", "--batch-size", "2",
        "--producers", "2", "--port", str(port), "--metrics-port", "-1", "--summary-json", str(summary),
        "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    text = procs.log(p)
    assert "Traceback" not in text
    assert f"{data}:21: JSON nested too deeply to parse" in text and f"{data}:22: JSON nested" in text
    assert json.loads(summary.read_text())["stopped_by"] == "end of data"


@pytest.mark.slow
def test_a_run_given_a_file_twice_trains_it_once_and_says_so_once(procs, tmp_path, port, tok):
    """`lmpipe run --data dir dir/a.txt` (and a link in dir to a.txt) trained a.txt three times an epoch."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("\n\n".join(f"document {i} " + "words " * (i % 9) for i in range(60)) + "\n")
    (d / "link.txt").symlink_to("a.txt")
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--data", str(d), str(d / "a.txt"), "--epochs", "1", "--steps", "0", "--consume-only",
        "--producers", "2", "--port", str(port), "--metrics-port", "-1", "--summary-json", str(summary),
        name="run",
    )  # fmt: skip
    assert procs.wait(p, timeout=120) == 0, procs.log(p)
    said = [line for line in procs.log(p).splitlines() if "more than once" in line]
    assert len(said) == 1 and said[0].endswith(  # by the launcher, before it forks its producers
        f"[trainer] --data reaches 1 file(s) more than once; each is read once, where it first comes: "
        f"{d}/a.txt (again as {d}/link.txt, {d}/a.txt)"
    ), said
    once = sum(len(doc.ids) for doc in DocStream(Corpus([str(d / "a.txt")]), tok, shuffle_window=0).docs(0))
    assert json.loads(summary.read_text())["tokens"] == once
