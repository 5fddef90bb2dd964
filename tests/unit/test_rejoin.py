"""A producer that reconnects replaces its own registration; hellos left on its old connection register
nothing (the phantoms of a trainer paused past the heartbeat timeout, issue 35)."""

from __future__ import annotations

import time

from lmpipe.shared import messages
from lmpipe.shared.wire import WIRE_VERSION
from tests.coordinators import coordinator


def hello(pid: int, session: str = "", rejoin: bool = False) -> messages.Hello:
    return messages.Hello(fingerprint={}, pid=pid, host="h", session=session, rejoin=rejoin,
                          wire=WIRE_VERSION)  # fmt: skip


def test_a_stale_hello_registers_nothing_and_a_rejoin_keeps_name_shards_and_leases():
    co = coordinator(4, 2)
    co._hello(b"a", hello(1))
    co._hello(b"b", hello(2))
    p0 = co.producers[b"a"]
    held, leases = set(p0.shards), {s: co.ledger[s].lease for s in p0.shards}
    assert held and len(co.producers) == 2
    co._hello(b"\x00stale", hello(1, co.session))  # queued before the drop, on the renamed old pipe
    assert list(co.producers) == [b"a", b"b"]
    sent = len(co._router.sent)  # type: ignore[union-attr]
    co._hello(b"a-again", hello(1, co.session, rejoin=True))
    assert set(co.producers) == {b"a-again", b"b"}
    p = co.producers[b"a-again"]
    assert p is p0 and p.name == "producer #0" and p.shards == held
    assert {s: co.ledger[s].lease for s in held} == leases, "its streams go on"
    assert all(co.ledger[s].identity == b"a-again" for s in held)
    answers = co._router.sent[sent:]  # type: ignore[union-attr]
    assert {to for to, _ in answers} == {b"a-again"}
    assert {type(m).__name__ for _, m in answers} == {"Assign", "Welcome"}
    assert co.wait_line(time.monotonic()).startswith("2 producer(s) connected")


def test_a_new_process_at_the_same_host_and_pid_joins_as_before():
    co = coordinator(4, 1)
    co._hello(b"a", hello(1))
    co._hello(b"n", hello(1))  # another session (none yet): not a reconnection of p0
    assert set(co.producers) == {b"a", b"n"} and co.producers[b"n"].name == "producer #1"
