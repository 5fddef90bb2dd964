"""A corpus file changed under a run, as formats.check_unchanged tells it: a touch (or a copy of the same
bytes over it) is read on, said once; a file of the same size and time put in its place, or rewritten in
place with its time set back, stops the run; a file:// URL of a local file is that file: checked, hashed and
read once as its path is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmpipe.producer.sources import Corpus
from tests.helpers import REPO, lmpipe_env


def test_a_file_url_of_another_host_is_one_line(tmp_path):
    """file://otherhost/path was read as the relative path otherhost/path (fsspec), or not found: another
    machine's file cannot be read as a local one. One line, naming the URL and what to give instead; the
    command exits 2 without a traceback."""
    url = "file://otherhost/data/corpus.txt"
    with pytest.raises(ValueError) as err:
        Corpus([url])
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"{url}: names host 'otherhost'; ") and "file:///" in said
    out = subprocess.run([sys.executable, "-m", "lmpipe", "prepare", "--data", url, "--out", str(tmp_path / "out")],
                         env=lmpipe_env(), cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{url}: names host 'otherhost'; " in lines[0], out.stderr
    assert not (tmp_path / "out").exists()
