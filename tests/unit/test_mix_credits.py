"""A mixture's credits on the control side (consumer/coordinator.py): every welcome carries its shard's
credit (2 past the last consumed), consumed batches are granted in one Credit per producer, and a holder's
heartbeat is answered with its credits again, so that a lost Credit cannot stall a shard."""

from __future__ import annotations

from lmpipe.shared import messages
from lmpipe.shared.wire import WIRE_VERSION
from tests.coordinators import coordinator


def hello(pid: int, session: str = "", holding: list[int] | None = None) -> messages.Hello:
    return messages.Hello(fingerprint={}, pid=pid, host="h", session=session, holding=holding or [],
                          wire=WIRE_VERSION)  # fmt: skip


def test_welcomes_carry_credit_and_consumed_batches_are_granted_per_producer():
    co = coordinator(4, 2)
    co.credit_window = 2
    co._hello(b"a", hello(1))
    co._hello(b"b", hello(2))
    router = co._router
    welcomes = [m for _, m in router.sent if isinstance(m, messages.Welcome)]  # type: ignore[union-attr]
    assert sorted(w.shard for w in welcomes) == [0, 1, 2, 3] and {w.credit for w in welcomes} == {2}
    for s, seq in ((0, 1), (1, 3), (2, 1)):
        co.ledger[s].last_seq = seq
    del router.sent[:]  # type: ignore[union-attr]
    co.grant({0, 1, 2})
    credits = {to: m.grants for to, m in router.sent}  # type: ignore[union-attr]
    owner = {s: co.ledger[s].identity for s in range(4)}
    assert len(router.sent) == len({owner[s] for s in (0, 1, 2)})  # type: ignore[union-attr]
    assert {s: g for grants in credits.values() for s, g in grants.items()} == {0: 3, 1: 5, 2: 3}
    del router.sent[:]  # type: ignore[union-attr]
    p = co.producers[b"a"]  # a heartbeat: its credits again
    co._hello(b"a", hello(1, co.session, sorted(p.shards)))
    (to, msg), *_ = router.sent  # type: ignore[union-attr]
    assert to == b"a" and set(msg.grants) == p.shards


def test_without_a_mixture_welcomes_have_no_limit_and_nothing_is_granted():
    co = coordinator(2, 1)
    co._hello(b"a", hello(1))
    sent = co._router.sent  # type: ignore[union-attr]
    assert {m.credit for _, m in sent if isinstance(m, messages.Welcome)} == {None}
    del sent[:]
    co.grant({0, 1})
    co._hello(b"a", hello(1, co.session, [0, 1]))
    assert not any(isinstance(m, messages.Credit) for _, m in sent)
