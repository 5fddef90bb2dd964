"""Wire protocol: round trips of every dtype and strategy; every malformed kind is rejected by reason."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, batch_from_message, end_frames
from lmpipe.shared.wire import DTYPES, WIRE_VERSION, Limits, WireError, decode, encode
from tests.helpers import ListStream

HDR = {"kind": "batch", "session": "s", "shard": 0, "seq": 1, "cursor": Cursor().to_dict(), "strategy": "pack",
       "counts": {"tokens": 0, "pad": 0, "docs": 0}}  # fmt: skip


def as_bytes(frames):
    return [bytes(f) if not isinstance(f, bytes) else f for f in frames]


@pytest.mark.parametrize("dname", sorted(DTYPES))
def test_round_trip_every_dtype(dname):
    rng = np.random.default_rng(0)
    arr = (rng.random((3, 5)) * 100).astype(DTYPES[dname])
    msg = decode(as_bytes(encode(HDR, {"x": arr, "empty": np.zeros((0, 4), DTYPES[dname])})))
    np.testing.assert_array_equal(msg.arrays["x"], arr)
    assert msg.arrays["x"].dtype == DTYPES[dname]
    assert msg.arrays["empty"].shape == (0, 4)
    assert msg.header["v"] == WIRE_VERSION


def test_arrays_go_out_without_a_copy():
    arr = np.arange(100_000, dtype=np.uint16)
    frames = encode(HDR, {"tokens": arr})
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint16), arr)


@pytest.mark.parametrize("strategy", ["pad", "pad-batch", "bucket", "pack"])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_every_strategy(strategy, dtype):
    docs = [list(range(1, n)) for n in (5, 30, 17, 2, 64, 9, 40)]
    spec = BatchSpec(strategy=strategy, seq_len=16, batch_size=3, bucket_k=4)
    for b in batches(ListStream(docs), spec, epochs=1, dtype=dtype):
        frames = as_bytes(b.to_frames("sess", 1, 7))
        msg = decode(frames)
        got = batch_from_message(msg, vocab_size=100, seq_len=16, max_rows=3)
        for name, arr in b.arrays().items():
            np.testing.assert_array_equal(got.arrays()[name], arr)
        assert got.cursor == b.cursor and got.strategy == strategy
        assert got.num_targets() == b.num_targets()
        assert msg.header["seq"] == 7 and msg.header["shard"] == 1


def _valid_frames():
    (b,) = list(
        batches(ListStream([[1, 2, 3, 4]]), BatchSpec(strategy="pack", seq_len=8, batch_size=2), epochs=1)
    )
    return as_bytes(b.to_frames("s", 0, 1))


def _with_header(**changes):
    frames = _valid_frames()
    hdr = msgpack.unpackb(frames[0])
    hdr.update(changes)
    return [msgpack.packb(hdr), *frames[1:]]


def _one_array(spec, data):
    return [msgpack.packb(dict(HDR, v=WIRE_VERSION, arrays=[spec])), data]


MALFORMED = {
    "random bytes": ([b"\x93\xff\x00garbage\xc1"], "bad_header"),
    "not a map": ([msgpack.packb([1, 2, 3])], "bad_header"),
    "no frames": ([], "bad_frames"),
    "wrong version": (_with_header(v=99), "bad_version"),
    "unknown kind": (_with_header(kind="exec"), "bad_kind"),
    "negative seq": (_with_header(seq=-1), "bad_header"),
    "bool as int": (_with_header(shard=True), "bad_header"),
    "unknown dtype": (_one_array(["tokens", "object", [1, 4]], b"x" * 32), "bad_dtype"),
    "bad shape": (_one_array(["tokens", "uint16", [-1, 4]], b"x" * 8), "bad_shape"),
    "too many dims": (_one_array(["tokens", "uint16", [1, 1, 1, 1]], b"x" * 2), "bad_shape"),
    "truncated frame": (_valid_frames()[:1] + [_valid_frames()[1][:-3]] + _valid_frames()[2:], "truncated"),
    "frame too long": (
        _valid_frames()[:1] + [_valid_frames()[1] + b"xx"] + _valid_frames()[2:],
        "bad_length",
    ),
    "missing frame": (_valid_frames()[:-1], "bad_frames"),
    "oversized header": ([msgpack.packb({"v": 1, "pad": "x" * 70_000})], "oversized"),
    "oversized array": (_one_array(["tokens", "int64", [1 << 14, 1 << 14]], b"x"), "oversized"),
    "msgpack ext": ([msgpack.packb({"v": msgpack.ExtType(5, b"boom")})], "bad_header"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_messages_are_rejected_with_a_reason(name):
    frames, reason = MALFORMED[name]
    with pytest.raises(WireError) as err:
        decode(frames, Limits())
    assert err.value.reason == reason


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a: a.update(tokens=np.full((2, 8), 5000, np.uint16)), "token id outside"),
        (lambda a: a.update(lengths=np.array([9, 0], np.int32)), "lengths"),
        (lambda a: a.update(seg=a["seg"][:, ::-1].copy()), "seg"),
        (lambda a: a.update(doc_len=a["doc_len"] + 1), "counts"),
        (lambda a: a.pop("seg"), "missing array 'seg'"),
        (lambda a: a.update(tokens=np.zeros((2, 7), np.uint16)), "lengths do not fit"),
        (lambda a: a.update(lengths=a["lengths"].astype(np.int64)), "array 'lengths' is int64"),
    ],
)
def test_batches_that_do_not_add_up_are_rejected(change, reason):
    docs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    (b,) = list(batches(ListStream(docs), BatchSpec(strategy="pack", seq_len=8, batch_size=2), epochs=1))
    assert b.rows == 2
    arrays = b.arrays()
    change(arrays)
    hdr = dict(HDR, counts={"tokens": b.real_tokens, "pad": b.pad_tokens, "docs": 2})
    msg = decode(as_bytes(encode(hdr, arrays)))
    with pytest.raises(WireError, match=reason):
        batch_from_message(msg, vocab_size=100, seq_len=8, max_rows=2)


def test_batch_larger_than_the_slots_is_rejected():
    (b,) = list(
        batches(
            ListStream([list(range(1, 30))]), BatchSpec(strategy="pack", seq_len=8, batch_size=4), epochs=1
        )
    )
    msg = decode(as_bytes(b.to_frames("s", 0, 1)))
    with pytest.raises(WireError, match="exceeds slot"):
        batch_from_message(msg, vocab_size=100, seq_len=8, max_rows=2)


def test_end_message_round_trip():
    msg = decode(as_bytes(end_frames("s", 2, 9, Cursor(1, 0, 0, 0))))
    assert msg.kind == "end" and msg.header["seq"] == 9 and msg.arrays == {}


def test_control_messages_round_trip_and_reject_garbage():
    hello = messages.Hello(
        producer=1, fingerprint={"tokenizer": "abc", "seq_len": 128}, pid=7, host="h", holding=[0, 5],
        wire=WIRE_VERSION, skipped={"bad_json": 3}, data_content="0123abcd",
    )  # fmt: skip
    assert messages.unpack(messages.pack(hello)) == hello
    bye = messages.Bye(skipped={"empty": 2})
    assert messages.unpack(messages.pack(bye)) == bye
    assert messages.unpack(msgpack.packb({"type": "bye"})) == messages.Bye(), "a bye from before the counts"
    # an older producer's hello has no `wire`: it decodes, as version 0, for the trainer to refuse by name
    old = messages.unpack(msgpack.packb({"type": "hello", "worker": 1, "fingerprint": {}}))
    assert isinstance(old, messages.Hello) and old.wire == 0
    assert old.data_content == "", "a hello without `data_content` (an older producer): nothing to check"
    # and a key a trainer does not know (a newer producer's, as `data_content` is to an older trainer) is
    # passed over, not refused
    newer = messages.unpack(msgpack.packb({"type": "hello", "producer": 1, "fingerprint": {}, "later": "x"}))
    assert isinstance(newer, messages.Hello) and newer.producer == 1
    w = messages.Welcome("sess", 1, Cursor(0, 5, 3, 0).to_dict(), 12, shards=16)
    assert messages.unpack(messages.pack(w)) == w
    a = messages.Assign("sess", [1, 4], 16, 3)
    assert messages.unpack(messages.pack(a)) == a
    for raw, match in [
        (msgpack.packb({"type": "shell", "cmd": "rm"}), "unknown control message"),
        (msgpack.packb({"type": "hello", "producer": "0", "fingerprint": {}}), "type str"),
        (
            msgpack.packb({"type": "hello", "producer": 0, "fingerprint": {}, "holding": [1, True]}),
            "shard numbers",
        ),
        (
            msgpack.packb({"type": "hello", "producer": 0, "fingerprint": {}, "holding": [-1]}),
            "shard numbers",
        ),
        (
            msgpack.packb({"type": "hello", "producer": 0, "fingerprint": {}, "wire": "3"}),
            "hello.wire has type str",
        ),
        (
            msgpack.packb({"type": "hello", "producer": 0, "fingerprint": {}, "data_content": 5}),
            "hello.data_content has type int",
        ),
        (msgpack.packb({"type": "bye", "skipped": {"empty": "2"}}), r"bye.skipped\['empty'\] has type str"),
        (msgpack.packb({"type": "assign", "session": "s", "shards": [], "total": 0}), "impossible number"),
        (
            msgpack.packb({"type": "welcome", "session": "s", "shard": 3, "shards": 2}),
            "not one of its shards",
        ),
        (msgpack.packb({"type": "welcome", "shard": 0}), "lacks field 'session'"),
        (b"\xc1\xc1", "not valid msgpack"),
    ]:
        with pytest.raises(WireError, match=match):
            messages.unpack(raw)


def test_a_hello_names_remote_versions_only_in_their_digest_shape():
    """The receiver pins every location a hello's data_versions names: anything but Corpus.version_digest's
    shape is a bad hello, refused as one, not a pin (a pin stays for the run and goes into checkpoints)."""
    from lmpipe.shared import messages

    good = "0123456789abcdef:" + "0" * 32
    hello = messages.unpack(messages.pack(messages.Hello(producer=0, fingerprint={}, data_versions=good)))
    assert hello.data_versions == good
    assert messages.unpack(messages.pack(messages.Hello(producer=0, fingerprint={}))).data_versions == ""
    for bad in ("junk", good + "0", good.upper(), "x" * 10_000, ":" + "0" * 32):
        with pytest.raises(WireError, match="is not a versions digest"):
            messages.unpack(messages.pack(messages.Hello(producer=0, fingerprint={}, data_versions=bad)))
