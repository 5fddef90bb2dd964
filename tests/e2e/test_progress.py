"""Progress where work is long: the trainer's live line (elapsed time, ETA), a compiling trainer that says
so, and `lmpipe tokenizer train`'s progress on a terminal (a pseudo-terminal here) and in a log."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import free_port_pair, lmpipe_env


def test_tokenizer_train_reports_its_progress_and_time(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} about {'lm pipelines ' * (i % 7 + 1)}" for i in range(3000)))
    r = subprocess.run(
        [sys.executable, "-m", "lmpipe", "tokenizer", "train", "--data", str(corpus), "--vocab-size", "400",
         "--out", str(tmp_path / "tok.json")],
        cwd=tmp_path, env=lmpipe_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert re.search(r"^reading: 3,000 documents, 0\.\d MB of 0\.\d MB \(\d+%\), .*; learning the merges$",
                     r.stderr, re.M), r.stderr  # fmt: skip
    assert re.search(r"^wrote .*tok\.json: vocab size 400, hash \w+ \(in \d+s\)$", r.stdout, re.M), r.stdout


@pytest.mark.slow
def test_a_compiling_trainer_says_so(procs):
    if sys.platform != "linux":
        pytest.skip("torch.compile on CPU needs a C++ compiler; CI is Linux")
    p = procs.start(
        "run", "--compile", "--steps", "2", "--log-every", "1", "--builtin-docs", "100", "--seq-len", "32",
        "--batch-size", "2", "--port", str(free_port_pair()), "--metrics-port", "-1", name="compile",
    )  # fmt: skip
    assert p.wait(timeout=600) == 0, procs.log(p)[-3000:]
    log = procs.log(p)
    assert re.search(r"compiling the model \(torch\.compile, first step\)\.\.\.\n", log), log[-3000:]
    assert re.search(r"compiling the model \(torch\.compile, first step\): done in \d+", log), log[-3000:]
    assert re.search(r"^step 2/2 \| .* \| (\d+m)?\d+s$", log, re.M), "the last line: elapsed, no ETA left"


def test_prepare_reports_its_progress(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} about {'lm pipelines ' * (i % 7 + 1)}" for i in range(2000)))
    r = subprocess.run(
        [sys.executable, "-m", "lmpipe", "prepare", "--data", str(corpus), "--out", str(tmp_path / "shards")],
        cwd=tmp_path, env=lmpipe_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # one last line, the whole file read: it said 96% (the records' text, without the blank lines between)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("tokenizing:")]
    assert len(lines) == 1, r.stderr
    mb = f"{corpus.stat().st_size / 1e6:,.1f}"
    want = rf"tokenizing: 2,000 records, {mb} MB of {mb} MB \(100%\), .* elapsed"
    assert re.fullmatch(want, lines[0]), lines
    assert "wrote " in r.stdout and "2,000 documents" in r.stdout
