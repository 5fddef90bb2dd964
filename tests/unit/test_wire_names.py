"""Wire version 4 names a shard `shard` and a producer's own number `producer`; an older producer is still
refused by its version, in words, not as a malformed message."""

from __future__ import annotations

import msgpack

from lmpipe.consumer.admission import version_skew
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, end_frames
from lmpipe.shared.wire import WIRE_VERSION, decode


def test_batch_and_welcome_name_the_shard():
    hdr = decode([bytes(f) for f in end_frames("s", 3, 9, Cursor(1))]).header
    assert hdr["shard"] == 3 and "worker" not in hdr
    w = messages.unpack(messages.pack(messages.Welcome("s", 2, shards=4)))
    assert w.shard == 2


def test_a_version_3_hello_decodes_and_is_refused_by_its_version():
    old = msgpack.packb({"type": "hello", "worker": 1, "fingerprint": {}, "wire": 3, "pid": 5, "host": "h"})
    hello = messages.unpack(old)
    assert (hello.wire, hello.producer) == (3, -1)
    assert WIRE_VERSION == 6
    assert version_skew(hello.wire) == (
        "wire version mismatch: the producer speaks wire version 3, the trainer speaks wire version 6; "
        "run the same lmpipe version on both sides"
    )
