"""Credits on the control channel: `credit` round-trips with its shards as numbers, a welcome carries its
shard's credit (None: unlimited, a run without a mixture), and anything malformed is refused, not trusted."""

from __future__ import annotations

import msgpack
import pytest

from lmpipe.shared import messages
from lmpipe.shared.wire import WireError


def test_credit_round_trips_with_numbered_shards():
    msg = messages.Credit("sess", {0: 3, 17: 12, 4095: 2**40})
    raw = messages.pack(msg)
    assert msgpack.unpackb(raw)["grants"] == {"0": 3, "17": 12, "4095": 2**40}  # string keys on the wire
    assert messages.unpack(raw) == msg
    assert messages.unpack(messages.pack(messages.Credit("s"))) == messages.Credit("s", {})


def test_welcome_carries_its_credit_and_none_means_unlimited():
    w = messages.unpack(messages.pack(messages.Welcome("s", 2, shards=4, credit=7)))
    assert w.credit == 7
    assert messages.unpack(messages.pack(messages.Welcome("s", 2, shards=4))).credit is None
    # a welcome without the field (none of a version-4 trainer's reach a version-5 producer: the hello's
    # wire version is refused first) decodes as unlimited
    old = {"type": "welcome", "session": "s", "shard": 1, "shards": 2}
    assert messages.unpack(msgpack.packb(old)).credit is None


@pytest.mark.parametrize(
    "body",
    [
        {"type": "credit", "grants": {"1": 2}},  # no session
        {"type": "credit", "session": "s", "grants": {"x": 2}},
        {"type": "credit", "session": "s", "grants": {"-1": 2}},
        {"type": "credit", "session": "s", "grants": {"4096": 2}},
        {"type": "credit", "session": "s", "grants": {"1": -2}},
        {"type": "credit", "session": "s", "grants": {"1": True}},
        {"type": "credit", "session": "s", "grants": {"1": 1.5}},
        {"type": "credit", "session": "s", "grants": [[1, 2]]},
        {"type": "welcome", "session": "s", "shard": 0, "credit": -1},
        {"type": "welcome", "session": "s", "shard": 0, "credit": "3"},
        {"type": "welcome", "session": "s", "shard": 0, "credit": False},
    ],
)
def test_malformed_credits_are_refused(body):
    with pytest.raises(WireError) as exc:
        messages.unpack(msgpack.packb(body))
    assert exc.value.reason == "bad_control"


def test_many_grants_are_split_into_messages_that_decode():
    grants = {s: s + 1 for s in range(450)}
    out = messages.credits("s", grants)
    assert [len(c.grants) for c in out] == [200, 200, 50]
    back: dict[int, int] = {}
    for c in out:
        back.update(messages.unpack(messages.pack(c)).grants)
    assert back == grants
    assert messages.credits("s", {}) == []
