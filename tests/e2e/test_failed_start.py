"""Issue 35 item 5: a start that fails after the port check leaves no `<port>.lock` in the runtime
directory (the check made it, and left it behind)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, lmpipe_env


def test_a_failed_start_leaves_no_lock_file(tmp_path: Path, port: int):
    run_dir = tmp_path / "rt"
    run_dir.mkdir(mode=0o700)
    out = subprocess.run([sys.executable, "-m", "lmpipe", "run", "--runtime-dir", str(run_dir), "--port", str(port),
                          "--tokenizer", str(tmp_path / "missing.json"), "--metrics-port", "-1"],
                         cwd=REPO, env=lmpipe_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--tokenizer" in out.stderr, out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [], list(run_dir.iterdir())
