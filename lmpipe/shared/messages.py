"""Control-channel messages (producer DEALER <-> trainer ROUTER), one place for every type.

Each message is a single msgpack map with a `type`. Producers say `hello` when they start (with their wire
version: the trainer refuses another at once) and repeat it every HELLO_EVERY seconds as a heartbeat,
naming the shards they hold; the trainer answers `assign` (the
whole set of shards this producer holds now, possibly none: it stands by), one `welcome` per shard to
start or restart (session, shard, cursor, next sequence number, lease, the global shards the rank's shards
are; in a mixture, its credit: how far it may send), `credit` (a mixture's: how far each shard may now send), `refuse` (with the reason; the
producer exits, as nothing it could retry would be answered otherwise) or `stop`, which a producer acknowledges with `bye`. A hello that names an old
session is answered like a new producer's: that is how a restarted trainer sends producers back to its
checkpointed cursors. A hello whose shards differ from the trainer's assignment is answered with what
differs, so a lost message heals at the next heartbeat; both answers are idempotent. `unpack` checks
every field's type, nested maps included, so nothing the
trainer does with a message can trip over a value it did not expect.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, cast

import msgpack

from lmpipe.shared.batch import Cursor
from lmpipe.shared.wire import CURSOR_KEYS, WireError, unpack_map

MAX_CONTROL_BYTES = 16 * 1024
SKIPPED_PER_MESSAGE = 128  # Hello.skipped's entries at most: msgpack maps are limited to 256 (wire.py)
HELLO_EVERY = 1.0  # seconds between a producer's hellos (its heartbeat)
ALIVE_SECONDS = 5.0  # a producer not heard from for this long no longer counts as connected
# A shard stays with its holder until its control connection closes, which ZMTP heartbeats force
# 30-32 s after a peer falls silent (shared/sockets.py); a holder silent this long loses it in any case.
HOLDER_SILENCE = 40.0
# How long a stopping trainer waits for every live producer's `bye`; a hello that arrives meanwhile is
# answered with `stop` again. A producer behind a congested link gets the stop only once its acknowledgements
# have queued through its link's buffer, plus TCP's retransmission back-off: 13-25 s behind 16 KiB at
# 8 kbit/s (tests/test_multihost.py), where 20 s lost the stop about one run in four and left the producer
# waiting for a trainer forever. A producer gone silent costs no more than before: the ZMTP heartbeat closes
# its connection 30-32 s after it fell silent, which counts as its bye.
STOP_GRACE = 60.0


# Corpus.version_digest's shape: what a hello may say there (the receiver pins each location it names)
VERSIONS_SHAPE = re.compile(r"[0-9a-f]{16}:[0-9a-f]{32}")


def version_location(data_versions: str) -> str:
    """Which objects a hello's data_versions speaks of (its part before the colon)."""
    return data_versions.partition(":")[0]


@dataclass
class Hello:
    fingerprint: dict[str, Any]
    producer: int = -1  # the producer's own number (--worker; -1: none), for logs only
    pid: int = 0
    host: str = ""
    session: str = ""
    rejoin: bool = False  # lost the control connection: asks for a welcome even in the same session
    holding: list[int] = field(default_factory=list)  # shards held in `session`
    # the producer's wire.WIRE_VERSION; 0: absent, a producer from before the hello carried it (version 2 or
    # older). The trainer refuses any version but its own here, before a batch is built.
    wire: int = 0
    # bad records skipped so far, "<shard>:<reason>" -> n, each shard counted from its epoch's start by the
    # stream this producer reads it with; the trainer keeps each shard's highest count (consumer/admission.py)
    skipped: dict[str, int] = field(default_factory=dict)
    # a digest of the corpus files' names, sizes and contents (Corpus.content_digest) beside the fingerprint's
    # `data` (names and sizes); "": none (the built-in corpus, shards, a remote file, or an older producer).
    # Outside the fingerprint, which an older trainer compares key by key; an older trainer ignores it.
    data_content: str = ""
    # remote objects' versions (Corpus.version_digest): "<location>:<digest>", the location a digest of the
    # objects' URLs, so that only producers reading the very same objects are compared (a copy in another
    # bucket may carry other ETags for the same bytes); "": none (local files, local and remote mixed, a
    # store that reports no version, an older producer). An older trainer ignores it.
    data_versions: str = ""
    waiting: str = ""  # what the producer waits on while it sends nothing (e.g. storage retries); "" when not


@dataclass
class Assign:
    """The shards this producer holds in `session`, all of them (empty: stand by). Shards it holds and
    this list lacks are given up at once; each shard it lacks comes with its own `welcome`."""

    session: str
    shards: list[int]
    total: int  # the run's number of shards (the split: record id % total)
    producers: int = 0  # live producers, for the log


@dataclass
class Welcome:
    session: str
    shard: int  # the shard to (re)start
    cursor: dict[str, int] = field(default_factory=lambda: Cursor().to_dict())
    next_seq: int = 1
    force: bool = False  # restart the stream even if the session is unchanged
    # The trainer's token for this holder of the shard, stamped on each of its batches: a message
    # without it (another peer's, or a previous holder's still in flight) is never trained on and cannot
    # make this producer rewind. Sent only on this producer's control connection.
    lease: str = ""
    shards: int = 1  # the run's number of shards
    # a mixture's pacing: the producer may send this shard's messages (batches and its end) up to this
    # sequence number, until a `credit` raises it; None: no limit (a run without a mixture)
    credit: int | None = None
    # the run's global shards (consumer/reshard.py): each source's shards are split `space` ways, and this
    # rank's shard j of a source is global shard `first` + j; None: the producer's own --rank/--world-size
    first: int | None = None
    space: int | None = None


@dataclass
class Credit:
    """Trainer -> producer, in a mixture: each named shard's messages may now be sent up to its sequence
    number (`grants`: shard -> upto_seq; a shard this producer does not hold in `session` is ignored). On
    the wire the shards are string keys (msgpack maps here take string keys); at most GRANTS_PER_MESSAGE
    a message: `credits()` splits a larger set."""

    session: str
    grants: dict[int, int] = field(default_factory=dict)


@dataclass
class Refuse:
    reason: str


@dataclass
class Stop:
    reason: str = ""


@dataclass
class Bye:
    """A producer's acknowledgement of `stop`: the trainer waits for it (up to STOP_GRACE) before it closes
    its sockets, so the end of a run reaches a producer behind a slow or congested link."""

    skipped: dict[str, int] = field(default_factory=dict)  # as in Hello: its final count


GRANTS_PER_MESSAGE = 200  # a Credit's grants at most (msgpack maps are limited to 256 here: wire.py)


def credits(session: str, grants: dict[int, int]) -> list[Credit]:
    """`grants` as Credit messages of at most GRANTS_PER_MESSAGE grants each (none for no grants)."""
    items = sorted(grants.items())
    k = GRANTS_PER_MESSAGE
    return [Credit(session, dict(items[i : i + k])) for i in range(0, len(items), k)]


TYPES: dict[str, type] = {
    "hello": Hello,
    "welcome": Welcome,
    "credit": Credit,
    "assign": Assign,
    "refuse": Refuse,
    "stop": Stop,
    "bye": Bye,
}
_NAMES = {cls: name for name, cls in TYPES.items()}
_PY: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "str": str,
    "bool": bool,
    "dict[str, Any]": dict,
    "dict[str, int]": dict,
    "list[int]": list,
    "int | None": (int, type(None)),
    "dict[int, int]": dict,
}
MAX_SHARDS = 4096  # a shard list longer than this, or naming a shard beyond it, is malformed
_SCALARS = (str, int, float, bool, type(None))  # what a fingerprint value may be


def _check_map(name: str, val: dict, values: tuple[type, ...]) -> None:
    for k, v in val.items():
        if not isinstance(k, str):
            raise WireError("bad_control", f"{name} has a {type(k).__name__} key")
        if not isinstance(v, values) or (isinstance(v, bool) and bool not in values):
            raise WireError("bad_control", f"{name}[{k!r}] has type {type(v).__name__}")


def pack(msg: Any) -> bytes:
    body = asdict(msg)
    if isinstance(msg, Credit):  # msgpack maps here take string keys
        body["grants"] = {str(k): v for k, v in msg.grants.items()}
    return msgpack.packb({"type": _NAMES[type(msg)], **body}, use_bin_type=True)


def _grants(val: dict) -> dict[int, int]:
    out = {}
    for k, v in val.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 4 and int(k) < MAX_SHARDS):
            raise WireError("bad_control", f"credit.grants names no shard: {k!r}")
        if type(v) is not int or v < 0:  # type(v) is int: no bools
            raise WireError("bad_control", f"credit.grants[{k!r}] is not a sequence number")
        out[int(k)] = v
    return out


def unpack(raw: bytes | memoryview) -> Any:
    """Decode and type-check one control message; raises WireError on anything unexpected."""
    obj = unpack_map(raw, MAX_CONTROL_BYTES, what="control message")
    name = obj.pop("type", None)
    cls = TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError("bad_control", f"unknown control message type {name!r}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in obj:
            if f.default is MISSING and f.default_factory is MISSING:
                raise WireError("bad_control", f"{name} lacks field {f.name!r}")
            continue
        val = obj[f.name]
        want = _PY[f.type] if isinstance(f.type, str) else cast(type, f.type)
        if isinstance(val, bool) and want is not bool or not isinstance(val, want):
            raise WireError("bad_control", f"{name}.{f.name} has type {type(val).__name__}")
        if f.type == "dict[str, Any]":
            _check_map(f"{name}.{f.name}", cast(dict, val), _SCALARS)
        elif f.type == "dict[str, int]":
            _check_map(f"{name}.{f.name}", cast(dict, val), (int,))
        elif f.type == "dict[int, int]":
            val = _grants(cast(dict, val))
        elif f.type == "int | None" and val is not None and cast(int, val) < 0:
            raise WireError("bad_control", f"{name}.{f.name} is negative")
        elif f.type == "list[int]":
            items = cast(list, val)
            if len(items) > MAX_SHARDS or not all(
                type(x) is int and 0 <= x < MAX_SHARDS for x in items
            ):  # type(x) is int: no bools
                raise WireError("bad_control", f"{name}.{f.name} is not a list of shard numbers")
        kwargs[f.name] = val
    total = cast(int, kwargs.get("shards" if cls is Welcome else "total", 1))
    if cls in (Welcome, Assign) and not 0 < total <= MAX_SHARDS:
        raise WireError("bad_control", f"{name} names an impossible number of shards")
    if cls is Welcome and not 0 <= cast(int, kwargs["shard"]) < total:
        raise WireError("bad_control", f"welcome.shard {kwargs['shard']} is not one of its shards")
    if cls is Welcome and kwargs.get("space") is not None:
        first, space = kwargs.get("first"), cast(int, kwargs["space"])
        if first is None or not 0 <= cast(int, first) < space <= MAX_SHARDS:
            raise WireError("bad_control", f"welcome.first {first} of space {space} names no global shard")
    if (
        cls is Hello
        and kwargs.get("data_versions")
        and not VERSIONS_SHAPE.fullmatch(cast(str, kwargs["data_versions"]))
    ):
        shown = cast(str, kwargs["data_versions"])[:60]
        raise WireError("bad_control", f"hello.data_versions {shown!r} is not a versions digest")
    if cls is Welcome and "cursor" in kwargs:
        cursor = cast(dict, kwargs["cursor"])
        if any(cursor.get(k, -1) < 0 for k in CURSOR_KEYS):
            raise WireError("bad_control", f"welcome.cursor {cursor!r} lacks or has negative fields")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise WireError("bad_control", f"{name}: {exc}") from None
