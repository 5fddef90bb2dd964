"""The exactly-once ledger, in process: every verdict on a batch, resume cursors and a new session."""

from __future__ import annotations

import pytest

from lmpipe.consumer import ledger as v
from lmpipe.consumer.ledger import Ledger
from lmpipe.shared.batch import Cursor


def at(n: int) -> Cursor:
    return Cursor(0, n, 0, 0)


def test_a_shards_batches_are_taken_in_order_each_once():
    led = Ledger(2, "s")
    assert led.classify(0, "s", 1) == v.NEXT
    assert led.accept(0, "s", 1, at(10)) == v.NEXT
    assert led.classify(0, "s", 1) == v.DUPLICATE  # the same batch again (a resend, a new holder)
    assert led.accept(0, "s", 1, at(99)) == v.DUPLICATE
    assert led[0].cursor == at(10) and led[0].last_seq == 1  # a duplicate moves nothing
    assert led.classify(0, "s", 3) == v.GAP  # seq 2 is missing
    assert led.accept(0, "s", 3, at(30)) == v.GAP
    assert led[0].last_seq == 1
    assert led.accept(0, "s", 2, at(20)) == v.NEXT
    assert led.classify(1, "s", 1) == v.NEXT  # shards are independent
    assert led.state_dict()[0] == {"cursor": at(20).to_dict(), "last_seq": 2, "finished": False}


def test_another_session_and_another_lease_are_never_trained():
    led = Ledger(1, "s")
    led[0].lease = "L"
    assert led.classify(0, "old", 1, "L") == v.OLD_SESSION
    assert led.accept(0, "old", 1, at(1)) == v.OLD_SESSION
    assert led.classify(0, "s", 1, "other") == v.NOT_HOLDER
    assert led.classify(0, "s", 1, "L") == v.NEXT
    assert led.classify(0, "s", 1) == v.NEXT  # no lease given: the step loop's question
    assert led[0].last_seq == 0


def test_an_end_finishes_its_shard_only_in_order():
    led = Ledger(2, "s")
    assert led.accept(0, "s", 2, at(5), end=True) == v.GAP
    assert not led[0].finished
    led.accept(0, "s", 1, at(4))
    assert led.accept(0, "s", 2, at(5), end=True) == v.NEXT
    assert led[0].finished and not led.all_finished()
    led.accept(1, "s", 1, at(1), end=True)
    assert led.all_finished()


def test_resume_restores_cursors_and_a_new_session_continues_after_them():
    old = Ledger(2, "first")
    old.accept(0, "first", 1, at(7))
    old.accept(0, "first", 2, at(9))
    old.accept(1, "first", 1, at(3), end=True)
    state = old.state_dict()
    new = Ledger(2, "second")  # a restarted trainer: a new session
    new.load_state_dict(state)
    assert (new[0].cursor, new[0].last_seq, new[0].finished) == (at(9), 2, False)
    assert new[1].finished
    assert new.classify(0, "first", 3) == v.OLD_SESSION  # the old session's batches still in flight
    assert new.classify(0, "second", 2) == v.DUPLICATE
    assert new.accept(0, "second", 3, at(11)) == v.NEXT


def test_a_checkpoint_of_another_shard_count_is_refused():
    with pytest.raises(ValueError, match="checkpoint has 2 shard cursors, this run has 3 shards"):
        Ledger(3, "s").load_state_dict(Ledger(2, "s").state_dict())


def test_missing_names_open_shards_nobody_serves():
    led = Ledger(3, "s")
    led[0].identity, led[0].last_seen = b"p", 100.0
    led[1].finished = True
    assert led.missing(101.0) == [2]
    assert led.missing(200.0) == [0, 2]  # its holder went silent
