"""The data-socket wire format: one msgpack header frame plus raw little-endian array frames.

Frame 0 is a msgpack map; frames 1..k are the bytes of the arrays it lists, in order. Arrays go out as
their own frames so that pyzmq can send them without copying (frames over zmq.COPY_THRESHOLD are
zero-copy), the same split vLLM's msgpack encoder makes. Nothing here unpickles, and `decode` checks
every field before a byte of array data is interpreted: a hostile or truncated message raises
`WireError` with a short reason that the receiver counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

# 2: batches may carry `loss_mask` (uint8 [B, L], 1 where a token is trained as a target); a version-1
# trainer would train on masked tokens, so it must refuse them rather than ignore the array.
# 3: the producer's hello names its version (messages.Hello.wire) and the trainer refuses any other at the
# handshake, before a batch is sent; a hello without it comes from version 2 or older.
# 4: "shard" where a shard is meant: the batch header's and Welcome's `worker` became `shard`, Hello's
# `worker` (the producer's own number) became `producer`, optional, so an older producer's hello still
# decodes and is refused by its version, not as malformed.
# 5: mixtures: the trainer paces each shard with credits (messages.Credit, Welcome.credit); a version-4
# producer would ignore them and flood the trainer with a source it does not need yet.
# 6: resume on another number of trainer ranks: Welcome.first and .space name the global shards a rank's
# shards are (consumer/reshard.py); a version-5 producer would read its own rank's layout instead.
WIRE_VERSION = 6

# name -> little-endian numpy dtype. Anything else is refused before it is read.
DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float32": np.dtype("<f4"),
}
KINDS = ("batch", "end")
STRATEGIES = ("pad", "pad-batch", "bucket", "pack")
CURSOR_KEYS = ("epoch", "pos", "offset", "skip")


class WireError(ValueError):
    """A message that must be dropped. `reason` is a short label used as a metric label; `header` is the
    decoded header map when the message got that far (it names the sender of a rejected batch)."""

    def __init__(self, reason: str, detail: str, header: dict[str, Any] | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.header = header


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces; a message over any of them is rejected as `oversized` (sizes) or
    `bad_shape` (dimensions). `shapes`, when given, names every array the receiver takes and the largest
    shape of each (see `lmpipe.shared.batch.batch_limits`, which derives them from the batch geometry)."""

    max_header_bytes: int = 64 * 1024
    max_arrays: int = 16
    max_ndim: int = 3
    max_array_bytes: int = 256 * 1024 * 1024
    max_dim: int = 1 << 24
    shapes: dict[str, tuple[int, ...]] | None = None

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a valid message has (the header or one array)."""
        return max(self.max_header_bytes, self.max_array_bytes)


@dataclass
class Message:
    header: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.header["kind"]


def _dtype_name(arr: np.ndarray) -> str:
    for name, dt in DTYPES.items():
        if arr.dtype == dt or arr.dtype == dt.newbyteorder("="):
            return name
    raise TypeError(f"dtype {arr.dtype} is not sendable; allowed: {sorted(DTYPES)}")


def encode(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> list[Any]:
    """Build the frames of one message. Arrays are sent as-is (no copy) when already contiguous and
    little-endian; the caller must not mutate them until the send completed."""
    arrays = arrays or {}
    specs = []
    frames: list[Any] = [b""]
    for name, arr in arrays.items():
        dname = _dtype_name(arr)
        arr = np.ascontiguousarray(arr, dtype=DTYPES[dname])
        specs.append([name, dname, list(arr.shape)])
        # memoryview of a 0-d or empty array is fine; pyzmq accepts any buffer.
        frames.append(arr.data if arr.size else b"")
    hdr = dict(header)
    hdr["v"] = WIRE_VERSION
    hdr["arrays"] = specs
    frames[0] = msgpack.packb(hdr, use_bin_type=True)
    return frames


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes/memoryview work directly.
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B")


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError("bad_header", f"msgpack ext type {code} not allowed")


def unpack_map(raw: memoryview | bytes, max_bytes: int, what: str = "header") -> dict[str, Any]:
    """msgpack-decode a map with hard size limits; used for data headers and control messages."""
    if len(raw) > max_bytes:
        raise WireError("oversized", f"{what} is {len(raw)} bytes, limit {max_bytes}")
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=4096,
            max_map_len=256,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"{what} is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise WireError("bad_header", f"{what} is a {type(obj).__name__}, expected a map")
    return obj


def _require(hdr: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in hdr:
        raise WireError("bad_header", f"missing field {key!r}")
    val = hdr[key]
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(val, bool) and typ is not bool or not isinstance(val, typ):
        raise WireError("bad_header", f"field {key!r} has type {type(val).__name__}")
    return val


def _check_header(hdr: dict[str, Any]) -> None:
    kind = _require(hdr, "kind", str)
    if kind not in KINDS:
        raise WireError("bad_kind", f"unknown kind {kind!r}")
    _require(hdr, "session", str)
    for key in ("shard", "seq"):
        if _require(hdr, key, int) < 0:
            raise WireError("bad_header", f"field {key!r} is negative")
    cursor = _require(hdr, "cursor", dict)
    for key in CURSOR_KEYS:
        if _require(cursor, key, int) < 0:
            raise WireError("bad_header", f"cursor field {key!r} is negative")
    if kind == "batch":
        strategy = _require(hdr, "strategy", str)
        if strategy not in STRATEGIES:
            raise WireError("bad_header", f"unknown strategy {strategy!r}")
        counts = _require(hdr, "counts", dict)
        for key in ("tokens", "pad", "docs"):
            if _require(counts, key, int) < 0:
                raise WireError("bad_header", f"count {key!r} is negative")


def decode(frames: Sequence[Any], limits: Limits = Limits()) -> Message:
    """Validate and decode one multipart message. Arrays are read-only views of the frames."""
    if not frames:
        raise WireError("bad_frames", "empty message")
    hdr = unpack_map(_buffer(frames[0]), limits.max_header_bytes)
    try:
        return _decode(hdr, frames, limits)
    except WireError as exc:
        exc.header = hdr  # untrusted, but it lets the receiver say whose batch it dropped
        raise


def _decode(hdr: dict[str, Any], frames: Sequence[Any], limits: Limits) -> Message:
    version = hdr.get("v")
    if version != WIRE_VERSION:
        raise WireError("bad_version", f"wire version {version!r}, this build speaks {WIRE_VERSION}")
    _check_header(hdr)
    specs = _require(hdr, "arrays", list)
    if len(specs) > limits.max_arrays:
        raise WireError("oversized", f"{len(specs)} arrays, limit {limits.max_arrays}")
    if len(frames) != len(specs) + 1:
        raise WireError("bad_frames", f"header lists {len(specs)} arrays but {len(frames) - 1} frames came")
    arrays: dict[str, np.ndarray] = {}
    for spec, frame in zip(specs, frames[1:]):
        if not (isinstance(spec, list) and len(spec) == 3):
            raise WireError("bad_header", "array spec is not [name, dtype, shape]")
        name, dname, shape = spec
        if not isinstance(name, str) or name in arrays:
            raise WireError("bad_header", f"bad or repeated array name {name!r}")
        if dname not in DTYPES:
            raise WireError("bad_dtype", f"array {name!r} has dtype {dname!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > limits.max_ndim
            or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= limits.max_dim for d in shape
            )
        ):
            raise WireError("bad_shape", f"array {name!r} has shape {shape!r}")
        if limits.shapes is not None:
            bound = limits.shapes.get(name)
            if bound is None:
                raise WireError("bad_header", f"unexpected array {name!r}")
            if len(shape) != len(bound) or any(d > b for d, b in zip(shape, bound)):
                raise WireError("bad_shape", f"array {name!r} has shape {shape!r}, at most {list(bound)}")
        dtype = DTYPES[dname]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > limits.max_array_bytes:
            raise WireError("oversized", f"array {name!r} would be {nbytes} bytes")
        buf = _buffer(frame)
        if len(buf) != nbytes:
            reason = "truncated" if len(buf) < nbytes else "bad_length"
            raise WireError(
                reason, f"array {name!r} {dname}{shape} needs {nbytes} bytes, frame has {len(buf)}"
            )
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return Message(header=hdr, arrays=arrays)
