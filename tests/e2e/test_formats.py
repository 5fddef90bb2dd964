"""Parquet, Arrow, Hugging Face save_to_disk folders and gzip/zstd JSONL: the same records as plain JSONL,
bad rows named by file and row, broken files stopped with one line, every format through `lmpipe prepare`
and through a real run (every document's tokens trained exactly once)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.corpora import builtin_docs, token_lengths, write
from tests.helpers import REPO, assert_exactly_once, read_doc_log


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    parquet = write(tmp_path / "c", ["x"], "parquet")
    zst = write(tmp_path / "c", ["x"], "jsonl.zst")
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['zstandard'] = None\n"
        "from lmpipe.cli import main\n"
        f"print('rc', main(['prepare', '--data', {str(parquet)!r}, '--out', {str(tmp_path / 'o')!r}]),"
        f" main(['prepare', '--data', {str(zst)!r}, '--out', {str(tmp_path / 'o')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "rc 2 2" in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in out.stderr
    assert f"{parquet}: reading Parquet needs pyarrow: pip install 'lmpipe[parquet]'" in lines[0]
    assert f"{zst}: reading zstd needs zstandard: pip install 'lmpipe[zstd]'" in lines[1]


@pytest.mark.slow
def test_every_format_trains_each_document_exactly_once(procs, tmp_path, port, tok):
    """One run over six files, one per format (record ids run on across them), two producers."""
    docs = builtin_docs(600)
    bad = {17, 140, 233, 333, 505}
    for i in bad:
        docs[i] = None
    paths = [
        str(write(tmp_path / f"part{k}", docs[100 * k : 100 * (k + 1)], fmt, rows_per_group=16))
        for k, fmt in enumerate(("jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-file", "hf"))
    ]
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", *paths, "--epochs", "1", "--steps", "0", "--seq-len", "64", "--batch-size", "8",
        "--shuffle-window", "64", "--port", str(port), "--metrics-port", "-1", "--log-every", "20",
        "--doc-log", str(log), "--summary-json", str(summary), "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=240) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0 and out["stale"] == 0
    good = {i: d for i, d in enumerate(docs) if d is not None}
    assert_exactly_once(read_doc_log(log), token_lengths(tok, good))
    text = procs.log(p)
    assert f"{paths[0]}:18: not valid JSON" in text  # record 17 is line 18 of the first file
    assert f"{paths[2]}:row 33: text is null" in text  # record 233 - 200
    assert f"{paths[3]}:row 33: text is null" in text
    assert f"{paths[5]}/data-00000-of-00002.arrow:row 5: text is null" in text  # record 505
    assert np.isfinite(out["last_loss"])
