"""Issue 35 item 1: half-open connections to /metrics from another user cannot stop a run.

A real `lmpipe run` (trainer and one producer, checkpoints every few steps) runs with at most 1024 open
files; a process forked from the test drops to `nobody` and holds 2,000 half-open HTTP requests against the
trainer's and the producer's metrics ports, reopening the ones the server closes. Training and checkpoints
go on, and the trainer's descriptors and memory stay bounded. Before the bounded server, each connection
held a thread and a descriptor, and the next checkpoint failed with `Too many open files`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, Procs, free_ports, lmpipe_env, wait_until

NOBODY = 65534
OPEN_FILES = 1024
CONNECTIONS = {"trainer": 1600, "producer": 400}  # 2,000 in all
FLOOD_SECONDS = 12.0  # longer than the server's 5 s deadline per request: it must cut them off and go on
QUIET_SECONDS = 6.0
FD_BOUND = 64  # the trainer's descriptors over its count before the flood
RSS_BOUND = 64 * 2**20

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="the flood comes from another user (nobody): run as root on Linux to start it",
)


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def _flood(ports: dict[int, int], seconds: float, report: int) -> None:
    """In a forked child, as nobody: keep len(ports[p]) half-open requests open to each port p."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))  # as root, before the drop
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    held: list[tuple[int, socket.socket]] = []
    opened = reopened = 0

    def connect(port: int) -> socket.socket:
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, OSError):
            s.connect(("127.0.0.1", port))
        return s

    for port, n in ports.items():
        held += [(port, connect(port)) for _ in range(n)]
    opened = len(held)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for i, (port, s) in enumerate(held):
            try:  # the request's first line and no end: a half-open request
                s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                closed = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                closed = False
            except OSError as exc:
                closed = exc.errno not in (errno.EAGAIN, errno.ENOTCONN)
            if closed:
                s.close()
                held[i] = (port, connect(port))
                reopened += 1
        time.sleep(0.5)
    os.write(report, json.dumps({"uid": os.getuid(), "opened": opened, "reopened": reopened}).encode())
    os._exit(0)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _watch(pid: int, seconds: float) -> tuple[list[int], list[int]]:
    """The process's descriptor counts and RSS, sampled for `seconds`."""
    fds, rss = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fds.append(_fds(pid))
        rss.append(_rss(pid))
        time.sleep(0.25)
    return fds, rss


def _latest_checkpoint(folder: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in folder.glob("step-*") if p.name.split("-")[1].isdigit()]
    return max(steps, default=0)


def test_a_metrics_flood_from_another_user_stops_neither_training_nor_checkpoints(tmp_path: Path):
    procs = Procs(tmp_path)
    port, mport = free_ports(2), free_ports(2)
    ck = tmp_path / "ck"
    args = ["run", "--builtin-docs", "3000", "--epochs", "0", "--producers", "1", "--steps", "0",
            "--threads", "1", "--log-every", "5", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
            "--keep-checkpoints", "2", "--port", str(port), "--metrics-port", str(mport),
            "--summary-json", str(tmp_path / "summary.json")]  # fmt: skip
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "lmpipe", *args], stdout=log, stderr=subprocess.STDOUT,
                               env=lmpipe_env(), cwd=REPO, start_new_session=True,
                               preexec_fn=_limit_open_files)  # fmt: skip
    run.log_path = log_path  # type: ignore[attr-defined]
    procs.procs.append(run)
    try:
        wait_until(lambda: _latest_checkpoint(ck) >= 4, 180, "the first checkpoint")
        quiet = _watch(run.pid, QUIET_SECONDS)  # how much it varies by itself (steps, checkpoints)
        fds0, rss0 = max(quiet[0]), max(quiet[1])
        before = _latest_checkpoint(ck)
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            os.close(r)
            try:
                _flood({mport: CONNECTIONS["trainer"], mport + 1: CONNECTIONS["producer"]}, FLOOD_SECONDS, w)
            finally:
                os._exit(1)
        os.close(w)
        fds, rss = _watch(run.pid, FLOOD_SECONDS)
        _, status = os.waitpid(child, 0)
        report = json.loads(os.read(r, 4096) or b"{}")
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0 and report["uid"] == NOBODY, report
        assert report["opened"] == sum(CONNECTIONS.values())
        assert run.poll() is None, procs.log(run)[-3000:]
        assert _latest_checkpoint(ck) > before, "no checkpoint written during the flood"
        # the run went on during the flood and after it: checkpoints still written
        wait_until(lambda: _latest_checkpoint(ck) >= before + 8, 120, "two more checkpoints")
        assert max(fds) - fds0 < FD_BOUND, (quiet[0], fds)
        assert max(rss) - rss0 < RSS_BOUND, (quiet[1], rss)
        assert report["reopened"] > 0, "the server cut off no half-open request"
        os.killpg(run.pid, signal.SIGTERM)
        assert procs.wait(run, 120) == 0, procs.log(run)[-3000:]
        text = procs.log(run)
        assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["steps"] >= before + 8
    finally:
        procs.cleanup()
