"""The Loader's processes over its life, in this process with real producers: the end of its epochs stops
them at once (the loader kept), its state after close() still covers the last batch, and a loader dropped
without close() stops them when it is freed, not at some later garbage collection."""

from __future__ import annotations

import gc
from pathlib import Path

from lmpipe import Loader
from tests.helpers import free_ports, wait_until


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def small_loader(**settings: object) -> Loader:
    return Loader(seq_len=32, batch_size=2, producers=1, shards=2, builtin_docs=40, device="cpu",
                  port=free_ports(2), **settings)  # fmt: skip


def test_the_last_epoch_stops_the_producers_and_the_state_outlives_close():
    loader = small_loader(epochs=1)
    batches = iter(loader)
    next(batches)
    pids = loader.producer_pids
    n = 1 + sum(1 for _ in batches)  # ends with StopIteration
    assert pids and not [pid for pid in pids if alive(pid)], "reaped when the last epoch ended"
    state = loader.state_dict()
    assert state["batches"] == n and all(c["finished"] for c in state["cursors"])
    assert list(loader) == [], "a new `for` after the last epoch yields nothing"
    loader.close()
    assert loader.state_dict() == state, "the state after close() is the state after the last batch"


def test_a_loader_dropped_without_close_stops_its_producers_when_freed():
    loader = small_loader()
    next(iter(loader))
    pids = loader.producer_pids
    gc.disable()  # freed by reference counting alone
    try:
        del loader
        wait_until(lambda: not [pid for pid in pids if alive(pid)], 15, "the producers to stop")
    finally:
        gc.enable()
