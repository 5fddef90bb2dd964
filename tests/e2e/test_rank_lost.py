"""Issue 35 item 5: killing one torchrun rank makes rank 0 say in one line which rank was lost, not end in
gloo's RuntimeError traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, lmpipe_env, wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker `rank` (a child of its agent with RANK=rank)."""
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(child)
    return None


def test_a_killed_rank_is_named_by_rank_0(tmp_path: Path, port: int):
    log = tmp_path / "job.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lmpipe",
           "run", "--builtin-docs", "400", "--seq-len", "64", "--batch-size", "4", "--producers", "1", "--epochs",
           "0", "--steps", "0", "--log-every", "2", "--threads", "1", "--port", str(port), "--metrics-port", "-1"]  # fmt: skip
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=lmpipe_env(),
                               start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: re.search(r"(?m)^step [4-9]", log.read_text(errors="replace")), 240, "4 steps")
        victim = _rank_pid(job.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text(errors="replace")
    assert f"rank 1 (pid {victim}) of the torchrun job ended mid-run; rank 0 stops too" in text, text[-4000:]
    assert "Connection closed by peer" not in text and "gloo" not in text.lower(), text[-4000:]
