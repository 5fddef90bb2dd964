"""The trainer names a producer as the producer names itself: `producer N` in the join, leave and wait lines
for the process whose own lines say `[producer N]` (`lmpipe run`'s producer N); `producer #K` for one
without a number (--worker -1: compose, Kubernetes, Slurm), the K-th to join."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from lmpipe.cli import _role
from lmpipe.shared import messages
from lmpipe.shared.wire import WIRE_VERSION
from tests.coordinators import coordinator


def hello(pid: int, producer: int = -1, waiting: str = "", session: str = "") -> messages.Hello:
    return messages.Hello(fingerprint={}, pid=pid, host="h", wire=WIRE_VERSION, producer=producer,
                          waiting=waiting, session=session)  # fmt: skip


def test_a_numbered_producer_is_named_as_its_own_log_lines_name_it(caplog):
    caplog.set_level(logging.INFO, logger="lmpipe.trainer")
    co = coordinator(4, 2)
    co._hello(b"a", hello(10, producer=1, waiting="storage"))
    co._hello(b"b", hello(11, producer=0))  # the second: the shards are assigned
    names = {p.name for p in co.producers.values()}
    # the role `lmpipe produce --worker N` (and `lmpipe run`'s producer N) prefixes its own lines with
    assert names == {_role("produce", [None, SimpleNamespace(worker=n)]) for n in (0, 1)}
    assert names == {"producer 0", "producer 1"}
    assert co.wait_line(time.monotonic()) == "2 producer(s) connected; producer 1 waiting on storage"
    co._hello(b"c", hello(12))  # a producer without a number joins: it takes shards from the others
    joined = [r.getMessage() for r in caplog.records if "joined from" in r.getMessage()]
    assert joined[:2] == [
        "producer 1 joined from h:10: holds shards 0,1 (2 producers, 4 shards)",
        "producer 0 joined from h:11: holds shards 2,3 (2 producers, 4 shards)",
    ]
    assert (
        joined[2] == "producer #2 joined from h:12: holds shards 3 (from producer 0) (3 producers, 4 shards)"
    )
    caplog.clear()
    co._leave(co.producers[b"a"], "connection closed", "closed")
    (left,) = [r.getMessage() for r in caplog.records]
    assert left == (
        "producer 1 (h:10) left (connection closed): shards 0,1 moved 0 to producer 0, 1 to producer #2 "
        "(2 producers, 4 shards)"
    )


def test_a_number_already_registered_gets_its_join_order_too():
    """A producer restarted under the same --worker while its old registration lingers: two names, told
    apart."""
    co = coordinator(2, 1)
    co._hello(b"a", hello(10, producer=0))
    co._hello(b"b", hello(11, producer=0))
    assert [p.name for p in co.producers.values()] == ["producer 0", "producer 0 #1"]
