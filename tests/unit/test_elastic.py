"""Elastic producers (issue 12): producers join and leave a running job, the trainer re-divides the shards,
and every document is trained exactly once per epoch, across joins, kills, a SIGTERM and a trainer restart.

The split is the trainer's --shards (record id % shards), fixed for the run and recorded in its
checkpoints; which producer serves which shard changes with every join and leave (consumer/assign.py).
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import given
from hypothesis import strategies as st

from lmpipe.consumer.admission import SkippedRecords
from lmpipe.consumer.assign import balance


@given(
    st.integers(1, 20).flatmap(
        lambda n: st.tuples(
            st.just(n), st.lists(st.one_of(st.none(), st.integers(0, n - 1)), min_size=16, max_size=16)
        )
    ),
    st.sets(st.integers(0, 15)),
)
def test_balance_gives_every_open_shard_one_holder_and_even_shares(owners, open_shards):
    n, owner = owners  # owner[s]: the producer holding shard s, or None
    holdings = {f"p{i}".encode(): {s for s in range(16) if owner[s] == i} for i in range(n)}
    new = balance(holdings, open_shards)
    assert list(new) == list(holdings), "every producer is in the answer, in join order"
    assert sorted(s for v in new.values() for s in v) == sorted(open_shards), "each open shard once"
    sizes = [len(v) for v in new.values()]
    assert max(sizes) - min(sizes) <= 1, sizes
    for k, v in new.items():  # as few moves as possible: each keeps what it held, up to its share
        assert len(v & holdings[k]) == min(len(holdings[k] & open_shards), len(v)), (k, holdings[k], v)


def test_a_join_takes_from_the_most_loaded_and_nothing_else_moves():
    old = {b"a": {0, 1, 2, 3, 4}, b"b": {5, 6, 7}, b"c": set()}
    new = balance(old, set(range(8)))
    assert [len(v) for v in new.values()] == [3, 3, 2]
    assert new[b"b"] == {5, 6, 7} and new[b"a"] <= old[b"a"], "only the most loaded gave shards up"
    # a leave: its shards go to the others, the others keep theirs
    after = balance({b"a": new[b"a"], b"b": new[b"b"]}, set(range(8)))
    assert after[b"a"] >= new[b"a"] and after[b"b"] >= new[b"b"]
    # more producers than shards: the extra ones stand by
    many = balance({bytes([i]): set() for i in range(5)}, {0, 1, 2})
    assert sorted(len(v) for v in many.values()) == [0, 0, 1, 1, 1]
    assert all(not (x & y) for x, y in combinations(many.values(), 2))


def test_skipped_records_are_each_shards_highest_count():
    """Every holder of a shard reads it from its epoch's start in the same order: its counts grow along the
    same records, so a moved shard, a restarted producer, or two producers with the same host and pid
    (containers) count each bad record once."""
    s = SkippedRecords()
    assert s.update({"3:bad_json": 5, "4:empty": 1}, shards=8)
    assert not s.update({"3:bad_json": 2}, shards=8), "a new holder of shard 3, reading from the start"
    assert s.update({"3:bad_json": 7, "4:empty": 1}, shards=8)
    assert not s.update({"9:bad_json": 50, "x:bad_json": 1, "3:": 4, "4:empty": -3}, shards=8)
    assert s.by_reason() == {"bad_json": 7, "empty": 1}
