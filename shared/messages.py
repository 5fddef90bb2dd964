"""Control-channel messages (producer DEALER <-> trainer ROUTER), one place for every type.

Each message is a single msgpack map with a `type`. Producers say `hello` when they start and send
`heartbeat`s while they run; the trainer answers `welcome` (session, cursor, next sequence number),
`refuse` (with a reason, and whether retrying can help) or `stop`. A heartbeat that names an old
session is answered with a fresh `welcome`: that is how a restarted trainer sends producers back to its
checkpointed cursors.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import msgpack

from lmpipe.shared.batch import Cursor
from lmpipe.shared.wire import WireError, unpack_map

MAX_CONTROL_BYTES = 16 * 1024


@dataclass
class Hello:
    worker: int
    num_workers: int
    fingerprint: dict[str, Any]
    pid: int = 0
    host: str = ""
    session: str = ""


@dataclass
class Welcome:
    session: str
    worker: int
    cursor: dict[str, int] = field(default_factory=lambda: Cursor().to_dict())
    next_seq: int = 1
    force: bool = False  # restart the stream even if the session is unchanged


@dataclass
class Refuse:
    reason: str
    retry: bool = False


@dataclass
class Heartbeat:
    worker: int
    session: str
    seq: int = 0
    finished: bool = False


@dataclass
class Stop:
    reason: str = ""


TYPES: dict[str, type] = {
    "hello": Hello,
    "welcome": Welcome,
    "refuse": Refuse,
    "heartbeat": Heartbeat,
    "stop": Stop,
}
_NAMES = {cls: name for name, cls in TYPES.items()}
_PY = {"int": int, "str": str, "bool": bool, "dict[str, Any]": dict, "dict[str, int]": dict}


def pack(msg: Any) -> bytes:
    return msgpack.packb({"type": _NAMES[type(msg)], **asdict(msg)}, use_bin_type=True)


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
        want = _PY[f.type] if isinstance(f.type, str) else f.type
        if isinstance(val, bool) and want is not bool or not isinstance(val, want):
            raise WireError("bad_control", f"{name}.{f.name} has type {type(val).__name__}")
        kwargs[f.name] = val
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise WireError("bad_control", f"{name}: {exc}") from None
