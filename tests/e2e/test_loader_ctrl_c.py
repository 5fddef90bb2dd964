"""A Loader's `with` block ends, and takes every process with it, however a Ctrl-C or a producer times it:
a Ctrl-C that lands while the training loop holds the batch queue's lock (seen only on a loaded machine,
placed there on purpose here), a producer deaf to the stop and to SIGTERM (killed after its grace, said in
one line), and a Ctrl-C caught (a notebook's) while start() waits for the receive thread's sockets."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import lmpipe.zygote
from lmpipe import Loader
from tests.helpers import REPO, free_ports, lmpipe_env


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# The user's loop takes batches as fast as it can, so that the receive thread puts the next one while the
# loop waits in the batch queue's get(). At its 6th batch a profile hook sends the process SIGINT inside that
# get(), at the first place after a lock was taken where Python runs a signal handler: the return of a
# Python-level __enter__ (queue.Queue's Condition: its lock held, the `with` that gives it back not yet
# entered), or, for a queue with no such place, its C get(). Before it, the loop stays there 0.5 s, as a
# thread descheduled on a loaded machine would, while the receive thread fills the slot the last batch freed.
USER = """
import json, os, signal, sys, time
from lmpipe import Loader

loader = Loader(seq_len=64, batch_size=4, producers=2, shards=4, epochs=0, builtin_docs=300,
                port=int(sys.argv[1]), device="cpu")


def ctrl_c():
    sys.setprofile(None)
    time.sleep(0.5)
    print("ctrl-c", flush=True)
    os.kill(os.getpid(), signal.SIGINT)


def hook(frame, event, arg):
    q = loader._pipe.receiver.ready  # the batch queue, receive thread -> training loop
    if event == "c_call" and getattr(arg, "__self__", None) is q:
        ctrl_c()
    elif event == "return" and frame.f_code.co_name == "__enter__":
        f = frame.f_back
        while f is not None and not (f.f_code.co_name == "get" and f.f_locals.get("self") is q):
            f = f.f_back
        if f is not None:
            ctrl_c()


with loader:
    print(json.dumps({"pids": loader.producer_pids}), flush=True)
    for n, batch in enumerate(loader):
        if n == 5:
            sys.setprofile(hook)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_ctrl_c_while_the_loop_holds_the_batch_queues_lock_still_stops_every_producer(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", USER, str(free_ports(2))], cwd=REPO, env=lmpipe_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout is not None
        pids = json.loads(p.stdout.readline())["pids"]
        zygote = parent(pids[0])
        assert p.stdout.readline().strip() == "ctrl-c"
        _, err = p.communicate(timeout=60)  # before the fix: the receive thread blocked for good, 65 s
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err[-3000:]
    for i in range(2):  # told to stop by the receive thread, not terminated after a grace
        assert f"[producer {i}] trainer says stop: SIGINT" in err, err[-3000:]
    assert "did not finish" not in err and "ignored SIGTERM" not in err, err[-3000:]
    assert not [pid for pid in [*pids, zygote] if alive(pid)]


def test_a_producer_deaf_to_the_stop_and_to_sigterm_is_killed_after_its_grace(monkeypatch, caplog):
    monkeypatch.setattr(lmpipe.zygote, "GRACE", 1.0)  # the seconds a producer has for each stage
    loader = Loader(seq_len=32, batch_size=2, producers=2, shards=2, builtin_docs=200, device="cpu",
                    port=free_ports(2))  # fmt: skip
    raises = pytest.raises(ValueError, match="the user's loop failed")
    with raises, caplog.at_level(logging.WARNING), loader:
        next(iter(loader))
        pids = loader.producer_pids
        os.kill(pids[1], signal.SIGSTOP)  # hears neither the stop nor SIGTERM; SIGKILL still ends it
        t0 = time.monotonic()
        raise ValueError("the user's loop failed")
    took = time.monotonic() - t0
    assert took < 20, f"the with block took {took:.0f} s to end"  # before: 65 s for the stopped one's bye
    said = [r.getMessage() for r in caplog.records]
    assert f"producer pid {pids[1]} ignored SIGTERM; killing it" in said, said
    assert not [pid for pid in pids if alive(pid)]


def test_a_ctrl_c_while_start_waits_for_the_receive_threads_sockets_ends_that_thread(monkeypatch):
    """Ctrl-C in a notebook: the KeyboardInterrupt is caught and the process goes on, so nothing the loader
    started may stay behind. It lands inside Pipeline.start's wait for the receive thread's sockets, at the
    first place after a lock was taken where Python runs a signal handler (threading.Event: its Condition's
    __enter__, whose lock that thread's set() then waits for)."""

    def hook(frame, event, arg):
        waiting = frame if frame.f_code.co_name == "wait" else frame.f_back
        while waiting is not None and waiting.f_code.co_name != "wait":
            waiting = waiting.f_back
        if waiting is None or waiting.f_back is None or waiting.f_back.f_code.co_name != "start":
            return
        if waiting.f_back.f_code.co_filename.endswith("pipeline.py") and (
            (event == "return" and frame.f_code.co_name == "__enter__")
            or (event == "c_return" and getattr(arg, "__name__", "") == "acquire")
        ):
            sys.setprofile(None)
            time.sleep(0.5)  # the receive thread binds its sockets and says so meanwhile
            os.kill(os.getpid(), signal.SIGINT)

    loader = Loader(seq_len=32, batch_size=2, producers=1, shards=2, builtin_docs=40, device="cpu",
                    port=free_ports(2))  # fmt: skip
    sys.setprofile(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            loader.start()
    finally:
        sys.setprofile(None)
    deadline = time.monotonic() + 15
    while any(t.name == "lmpipe-receiver" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "lmpipe-receiver"], "the receive thread ended"
    assert loader.producer_pids == [] and loader._zygote is None, "the producers were reaped"
