"""The Loader's local producers come from one zygote (lmpipe/zygote.py): real processes, each seen by the
Loader on its own (pid, exit status), and none outlives what started it: the `with` block, the zygote, or
the user's process."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmpipe import Loader
from tests.helpers import REPO, free_ports, lmpipe_env, wait_until


def state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return state(pid) not in (None, "Z")


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children(of: int, named: bytes = b"") -> list[int]:
    """The processes whose parent is `of` (and whose command line holds `named`)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if parent(int(stat.parent.name)) == of and named in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def small_loader() -> Loader:
    return Loader(seq_len=32, batch_size=2, producers=2, shards=4, builtin_docs=200, device="cpu",
                  port=free_ports(2))  # fmt: skip


def until_stopped(loader: Loader, seconds: float = 60) -> str:
    """Iterate until the loader stops with its RuntimeError; its message."""
    deadline = time.monotonic() + seconds
    try:
        for _ in loader:
            assert time.monotonic() < deadline, "the loader went on"
            time.sleep(0.01)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the loader ended without an error")


def test_producers_are_real_processes_of_one_zygote_and_none_outlives_the_with_block():
    with small_loader() as loader:
        next(iter(loader))
        pids = loader.producer_pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        zygote = {parent(p) for p in pids}
        assert len(zygote) == 1, "one zygote forked them all"
        (zpid,) = zygote
        assert zpid != os.getpid() and parent(zpid) == os.getpid(), "forked by a child, not by this process"
    assert not [p for p in [*pids, zpid] if state(p) is not None], "reaped when the block ended"


def test_a_loader_never_started_ends_its_idle_zygote_when_closed_or_dropped():
    before = set(children(os.getpid(), b"lmpipe.zygote"))
    closed = small_loader()
    dropped = small_loader()
    started = set(children(os.getpid(), b"lmpipe.zygote")) - before
    assert len(started) == 2, "the constructor starts one zygote"
    assert not [p for z in started for p in children(z)], "and it forks nothing before the loader starts"
    closed.close()
    gc.disable()  # freed by reference counting alone
    try:
        del dropped
        assert not [p for p in started if state(p) is not None], "ended and reaped at once"
    finally:
        gc.enable()


def test_a_producer_killed_is_seen_with_its_exit_status():
    with small_loader() as loader:
        next(iter(loader))
        pids = loader.producer_pids
        os.kill(pids[1], signal.SIGKILL)
        said = until_stopped(loader)
    assert said == "producer 1 exited with code -9; the loader stopped"
    assert not [p for p in pids if state(p) is not None]


def test_the_zygote_killed_takes_its_producers_and_the_loader_says_so():
    with small_loader() as loader:
        next(iter(loader))
        pids = loader.producer_pids
        zpid = parent(pids[0])
        os.kill(zpid, signal.SIGKILL)
        said = until_stopped(loader)
    assert said == (
        f"the producers' zygote (pid {zpid}) was killed by SIGKILL; its producers went with it; the loader stopped"
    )
    assert not [p for p in pids if alive(p)]


# the zygote alone, in a process killed with -9 (no torch: the Loader's side of it is lmpipe/zygote.py)
USER = """
import json, sys, time
from lmpipe.shared.config import PipelineConfig
from lmpipe.zygote import Zygote
z = Zygote(PipelineConfig(producers=2, builtin_docs=20, port=int(sys.argv[1])), -1, "WARNING")
z.fork()
print(json.dumps({"zygote": z.pid, "pids": z.wait_started()}), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_users_process_takes_the_zygote_and_its_producers():
    p = subprocess.Popen([sys.executable, "-c", USER, str(free_ports(2))], cwd=REPO, env=lmpipe_env(),
                         stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout is not None
        got = json.loads(p.stdout.readline())
        assert all(parent(pid) == got["zygote"] for pid in got["pids"])
        p.kill()
        p.wait()
        for pid in [got["zygote"], *got["pids"]]:
            wait_until(lambda pid=pid: not alive(pid), 15, f"process {pid} to go after its user's kill -9")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
