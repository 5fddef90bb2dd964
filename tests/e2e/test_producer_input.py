"""Corpus files a hostile sweep found mishandled: a UTF-8 BOM read as content, an unreadable file in a --data
folder found only by the producers, a FIFO left out unsaid, a truncated .gz's progress under-reported, the
bad-record and lone-share wordings, and CR-only line endings left without a hint."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_an_unreadable_file_is_one_line_for_root_too(tmp_path):
    """As root (the hostile sweep ran so), without the capabilities that let root read any file."""
    d = tmp_path / "permdir"
    d.mkdir()
    (d / "a.txt").write_text("readable\n")
    (d / "b.txt").write_text("not readable\n")
    (d / "b.txt").chmod(0)
    drop = "-dac_override,-dac_read_search"
    code = "import sys; from lmpipe.producer.sources import Corpus; Corpus([sys.argv[1]])"
    try:
        r = subprocess.run(
            ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", "--", sys.executable, "-c", code, str(d)],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
    finally:
        (d / "b.txt").chmod(0o644)
    if "setpriv:" in r.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {r.stderr.strip()}")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        f"PermissionError: corpus file {d}/b.txt: cannot read it (Permission denied)"
    )
