"""Issue 39 item 2: under torchrun's elastic restarts (c10d rendezvous, --max-restarts), a rank killed with
SIGKILL makes the agent restart every worker; each resumes from the last checkpoint, and over the job
every document is trained exactly once (the killed round's steps after that checkpoint are trained again
by the next round, and left out of the count as in tests/e2e/test_resume.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    free_ports,
    lmpipe_env,
    trained_pieces,
    wait_until,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
DOCS = 300


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker `rank` (a child of its agent with RANK=rank)."""
    for child in _children(agent):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return child
        except OSError:
            continue
    return None


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_killed_rank_restarts_the_job_from_its_last_checkpoint_every_document_once(tmp_path, port, tok):
    ck, log = tmp_path / "ck", tmp_path / "job.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_ports(1)}",
           "-m", "lmpipe", "run", "--builtin-docs", str(DOCS), "--seq-len", "64", "--batch-size", "4",
           "--producers", "1", "--epochs", "1", "--steps", "0", "--log-every", "4", "--threads", "1",
           "--port", str(port), "--metrics-port", "-1", "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
           "--resume", "auto", "--doc-log", str(tmp_path / "docs.jsonl"),
           "--summary-json", str(tmp_path / "summary.json")]  # fmt: skip
    with open(log, "wb") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=lmpipe_env(),
                               start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: (ck / "step-00000006").is_dir() or job.poll() is not None, 120, "a checkpoint")
        victim = _rank_pid(job.pid, 1)
        assert victim is not None, log.read_text(errors="replace")[-3000:]
        producers = _children(victim)
        os.kill(victim, signal.SIGKILL)
        # its producer dies with it (the parent-death signal), before the restarted rank binds its ports
        wait_until(lambda: all(_gone(p) for p in producers), 5, "the killed rank's producer to end")
        rc = job.wait(timeout=150)
    finally:
        if job.poll() is None:  # torchrun starts each worker in a session of its own, with its producers
            for worker in _children(job.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker, signal.SIGKILL)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert f"rank 1 (pid {victim}) of the torchrun job ended mid-run; rank 0 stops too" in text, text[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    at = summary["first_step"]
    assert at >= 6 and summary["stopped_by"] == "end of data", summary
    assert summary["topology"] == {"world_size": 2, "shards": 16, "shard_space": 32, "resumed_step": at,
                                   "resumed_world_size": 2, "restarts": 1}  # fmt: skip
    assert f"resumed at {at}, after torchrun's restart 1)" in text
    pieces: dict[int, list[tuple[int, int]]] = {}
    for rank in (0, 1):
        entries = doc_log_entries(tmp_path / f"docs.rank{rank}.jsonl")
        first = entries[0]["batches"][0]["session"]  # the killed round's; its steps from `at` on came again
        assert any(b["session"] != first for e in entries for b in e["batches"]), "the rank trained again"
        for did, parts in trained_pieces(entries, first, at).items():
            pieces.setdefault(did, []).extend(parts)
    assert_exactly_once(pieces, builtin_lengths(tok, DOCS))
