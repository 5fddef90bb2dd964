"""Issue 35 item 5: a full disk under --doc-log or --summary-json is one line naming the file.

/dev/full answers every write with ENOSPC. The checks before the start make a folder beside the file to
prove it writable, which in /dev only root may do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, lmpipe_env

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/full") or not os.access("/dev", os.W_OK),
    reason="needs /dev/full and a writable /dev (root) to pass the start-up checks",
)


@pytest.mark.parametrize("flag", ["--doc-log", "--summary-json"])
def test_a_full_disk_names_the_file(flag, port):
    out = subprocess.run([sys.executable, "-m", "lmpipe", "run", "--steps", "2", "--builtin-docs", "200", "--port",
                          str(port), "--metrics-port", "-1", "--producers", "1", flag, "/dev/full"],
                         cwd=REPO, env=lmpipe_env(), capture_output=True, text=True, timeout=180)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"{flag} /dev/full: cannot write it (No space left on device)" in text, text
    assert "Traceback" not in text, text
