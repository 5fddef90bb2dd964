"""Object storage and any other fsspec URL: listing, ranged reads with bounded retries, files over them.

`--data s3://bucket/prefix` (or gs://, az://, https://, hf://, any protocol fsspec knows) reads objects
with ranged GETs: a streamed format holds one buffer of `BLOCK` bytes per open file, Parquet reads only
the column chunks it needs, prepared shards fetch each document's byte range. Nothing is downloaded whole.

Where the endpoint and credentials come from is left to the standard places, so nothing secret passes
through lmpipe's flags or logs: for S3, the AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL for MinIO/Ceph/R2/moto) and ~/.aws; for any
protocol, fsspec's configuration (FSSPEC_S3='{"endpoint_url": "..."}', FSSPEC_S3_ANON=true,
~/.config/fsspec/*.json), which wins over lmpipe's defaults.

One retry policy, lmpipe's: s3fs's and botocore's own retries are off, so every retry is one of ours and
logged. Transient errors (connection refused or reset, timeouts, 5xx, throttling) are retried RETRIES times
with exponential backoff (31.5 s of sleeps; with the eight attempts about 35 s against a stopped server),
each retry logged once; the request is then repeated exactly, so a restarted server changes nothing about which
bytes are read. Permanent errors (no such bucket or key, access denied or wrong credentials, a bad request,
TLS against a plain server, an endpoint name that does not resolve) stop at once with one line naming the
URL. WAITS tells the producer what it waits for (its hellos say so) and for how long (a metric), and lets a
producer that stops end a retry's sleep at once.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

log = logging.getLogger("lmpipe.producer")

T = TypeVar("T")

RETRIES = 7  # after the first attempt: waits of 0.5, 1, 2, 4, 8, 8, 8 s
BACKOFF = 0.5
MAX_BACKOFF = 8.0
BLOCK = 4 << 20  # bytes per ranged read of a streamed file (the buffer each open file holds)

# errno values s3fs gives client errors (bad request, redirect, too large, not implemented): not retried
_PERMANENT_ERRNO = {
    errno.EINVAL,
    errno.EPERM,
    errno.EACCES,
    errno.ENOENT,
    errno.ENAMETOOLONG,
    errno.EMSGSIZE,
    errno.ENOSYS,
    errno.ENOTEMPTY,
    errno.EREMCHG,
    errno.EISDIR,
    errno.ENOTDIR,
}
_TRANSIENT_NAMES = {
    # botocore
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "IncompleteReadError",
    # aiohttp (fsspec's HTTP and s3fs's transport)
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    # fsspec
    "FSTimeoutError",
}
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed"}  # fmt: skip


class StorageWaits:
    """What retry() tells the process it runs in (a producer sets these): `spent(seconds)` as time goes to
    storage calls and the sleeps between their retries; `retrying(text)` while a call is retried ("" once it
    is over); `sleep(seconds)` between retries (a producer's ends early, raising, once it stops)."""

    def __init__(self) -> None:
        self.spent: Callable[[float], None] = lambda seconds: None
        self.retrying: Callable[[str], None] = lambda text: None
        self.sleep: Callable[[float], None] = time.sleep


WAITS = StorageWaits()


class RemoteError(OSError):
    """A remote read that kept failing with transient errors after every retry."""


class MissingExtra(ValueError):
    """Data that needs an optional package (an extra of lmpipe) that is not installed: a config error,
    one line naming the extra."""


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


def _hopeless(exc: BaseException) -> str | None:
    """What makes a connection error permanent (no retry helps), or None: TLS spoken to a server that does
    not speak it (an https:// endpoint on a plain one), or an endpoint name that does not resolve."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, ssl.SSLError) or "SSLError" in names or "WRONG_VERSION_NUMBER" in str(e):
            return "TLS failed (an https:// endpoint on a plain-HTTP server, or a certificate not trusted)"
        if isinstance(e, socket.gaierror) or "ClientConnectorDNSError" in names:
            return "the endpoint's host name does not resolve"
        e = e.__cause__ or e.__context__
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth trying again: the network or the server, not the request."""
    if _hopeless(exc) is not None:
        return False
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None and is_transient(exc.__cause__):
        return True  # fsspec's HTTP info() turns a failed GET into "not found", a 503's too
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError):  # s3fs maps S3 error codes to errnos; EIO/EBUSY/EREMOTEIO are the server's
        return exc.errno not in _PERMANENT_ERRNO
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _TRANSIENT_NAMES:
        return True
    response = getattr(exc, "response", None)  # an untranslated botocore ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code", "")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    return isinstance(status, int) and (status >= 500 or status == 429)


def _permanent(what: str, exc: BaseException) -> Exception:
    """One line naming the URL; the type keeps FileNotFoundError/PermissionError for callers."""
    detail = _one_line(exc)
    hopeless = _hopeless(exc)
    if hopeless is not None:
        return OSError(f"{what}: {hopeless}: {type(exc).__name__}: {detail}")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{what}: not found ({detail})")
    if isinstance(exc, PermissionError) or type(exc).__name__ in (
        "NoCredentialsError",
        "PartialCredentialsError",
    ):
        return PermissionError(
            f"{what}: access denied ({detail}); set credentials the standard way (for S3: AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; FSSPEC_S3_ANON=true for a public bucket)"
        )
    if isinstance(exc, ValueError):
        return ValueError(f"{what}: {detail}")
    return OSError(f"{what}: {type(exc).__name__}: {detail}")


def retry(what: str, fn: Callable[[], T]) -> T:
    """fn(), again after each transient error (RETRIES times, backing off); permanent errors at once. The
    time it takes goes to WAITS.spent as it accrues; while it retries, WAITS.retrying says what."""
    retries, delay, t0 = RETRIES, BACKOFF, time.monotonic()
    mark, retried = t0, False

    def spent() -> None:
        nonlocal mark
        now = time.monotonic()
        WAITS.spent(now - mark)
        mark = now

    try:
        for attempt in range(retries + 1):
            try:
                return fn()
            except Exception as exc:
                spent()
                if isinstance(exc, RemoteError):
                    raise
                if not is_transient(exc):
                    raise _permanent(what, exc) from None
                if attempt == retries:
                    raise RemoteError(
                        f"{what}: still failing after {retries} retries over {time.monotonic() - t0:.0f} s: "
                        f"{type(exc).__name__}: {_one_line(exc)}"
                    ) from None
                log.warning(
                    "%s: %s: %s; retry %d/%d in %.1f s",
                    what,
                    type(exc).__name__,
                    _one_line(exc),
                    attempt + 1,
                    retries,
                    delay,
                )
                retried = True
                WAITS.retrying(f"{what} (retry {attempt + 1} of {retries})")
                WAITS.sleep(delay)
                spent()
                delay = min(2 * delay, MAX_BACKOFF)
        raise AssertionError("unreachable")
    finally:
        spent()
        if retried:
            WAITS.retrying("")


def _defaults(proto: str) -> dict[str, Any]:
    # One retry layer, ours (logged, bounded, whole requests): botocore's own would hide an outage for up
    # to ~10 s per request before ours saw it. Its `max_attempts` counts retries (1 still retried a 503
    # once), `total_max_attempts` the first attempt too. fsspec's configuration for the protocol wins.
    if proto in ("s3", "s3a"):
        return {
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 10, "read_timeout": 60}
        }
    return {}


@cache
def filesystem(proto: str) -> Any:
    """The fsspec filesystem for a protocol (one per process), or one line saying what to install."""
    try:
        import fsspec
        import fsspec.config
    except ImportError:
        raise MissingExtra(
            f"reading {proto}:// URLs needs fsspec: pip install 'lmpipe[s3]' (fsspec and s3fs; for other "
            "stores also their fsspec driver, e.g. gcsfs, adlfs)"
        ) from None
    opts = {**_defaults(proto), **fsspec.config.conf.get(proto, {})}
    for name in ("aiobotocore", "botocore"):  # "found credentials in ..." in every producer's log
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        fs = fsspec.filesystem(proto, **opts)
    except ImportError as exc:
        extra = "pip install 'lmpipe[s3]'" if proto in ("s3", "s3a") else "install its fsspec driver"
        raise MissingExtra(f"reading {proto}:// URLs: {_one_line(exc)} ({extra})") from None
    except ValueError as exc:
        raise ValueError(f"{proto}:// is not a protocol fsspec knows ({_one_line(exc)})") from None
    if proto in ("s3", "s3a") and "retries" not in fsspec.config.conf.get(proto, {}):
        # s3fs retries throttling (503 SlowDown) and some network errors 5 times itself, unlogged, beneath
        # ours (s3fs/core.py, _error_wrapper): one attempt each, so every retry is one of ours
        fs.retries = 1
    return fs


# A forked process (`lmpipe run`'s producers) makes its own: fsspec's async filesystems refuse to be used
# across a fork ("This class is not fork-safe"), and fsspec resets its own loop and instance cache there.
os.register_at_fork(after_in_child=filesystem.cache_clear)


# what a store says identifies an object's content, best first: GCS's MD5, or its CRC32C and generation
# for composite objects, which have no MD5 (GCS's etag also moves when only metadata changes), S3's and
# HTTP's ETag (an MD5 of the content for single-part uploads), an HTTP server's digest headers
VERSION_KEYS = ("md5Hash", "crc32c", "generation", "ETag", "etag", "Content-MD5", "Digest")


# an HTTP server's ETag may be per node behind a load balancer (nginx's time-size, Apache's inode-based), so
# it would read as a rewrite on the next request: there only a digest of the content is a version
HTTP_VERSION_KEYS = ("Content-MD5", "Digest")


def version(info: dict[str, Any], proto: str = "") -> str | None:
    """The object's version as its store (`proto`: remote.protocol's name) reports it, or None if it
    reports none."""
    for key in HTTP_VERSION_KEYS if proto.lower() in ("http", "https") else VERSION_KEYS:
        if info.get(key):
            return f"{key}={str(info[key]).strip(chr(34))}"
    return None


class Remote:
    """One URL's filesystem, with every call retried; paths given and returned are full URLs."""

    def __init__(self, url: str):
        self.proto = protocol(url)
        self.fs = filesystem(self.proto)

    def key(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def url(self, key: str) -> str:
        return self.fs.unstrip_protocol(key)

    def info(self, url: str) -> dict[str, Any]:
        return retry(url, lambda: self.fs.info(self.key(url)))

    def ls(self, url: str) -> list[tuple[str, int, str, str | None]]:
        """(url, size, type, version) of the entries directly under a directory URL, sorted by name."""
        entries = retry(url, lambda: self.fs.ls(self.key(url), detail=True))
        return sorted(
            (
                (self.url(e["name"]), int(e.get("size") or 0), e["type"], version(e, self.proto))
                for e in entries
            ),
            key=lambda e: e[0],
        )

    def glob(self, pattern: str) -> list[tuple[str, int, str | None]]:
        """(url, size, version) of the files a glob pattern matches, sorted."""
        found = retry(pattern, lambda: self.fs.glob(self.key(pattern), detail=True))
        return sorted(
            (self.url(k), int(v.get("size") or 0), version(v, self.proto))
            for k, v in found.items()
            if v["type"] == "file"
        )

    def read(self, url: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object."""
        key = self.key(url)
        return retry(f"{url} bytes {start}-{end}", lambda: self.fs.cat_file(key, start=start, end=end))

    def read_all(self, url: str) -> bytes:
        key = self.key(url)
        return retry(url, lambda: self.fs.cat_file(key))

    def read_many(self, url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Many byte ranges of one object, fetched concurrently where the filesystem can; each failed
        range is retried (the whole call is bounded by `retry`)."""
        key = self.key(url)
        out: list[bytes | None] = [None] * len(ranges)

        def fetch() -> None:
            todo = [i for i, v in enumerate(out) if v is None]
            got = self.fs.cat_ranges(
                [key] * len(todo),
                [ranges[i][0] for i in todo],
                [ranges[i][1] for i in todo],
                on_error="return",
            )
            first_error = None
            for i, v in zip(todo, got):
                if isinstance(v, BaseException):
                    first_error = first_error or v
                else:
                    out[i] = v
            if first_error is not None:
                raise first_error

        retry(f"{url} ({len(ranges)} ranges)", fetch)
        return out  # type: ignore[return-value]


class RangeReader(io.RawIOBase):
    """A seekable binary file over an object, every read one ranged GET (retried). Wrap it in
    io.BufferedReader for line reading; pyarrow reads it directly (its reads are column chunks)."""

    def __init__(self, remote: Remote, url: str, size: int):
        super().__init__()
        self.remote, self.url, self.size = remote, url, size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.remote.read(self.url, self.pos, self.pos + n)
        if not data:
            raise RemoteError(f"{self.url}: ended at byte {self.pos} of {self.size} (changed while reading?)")
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        out = self.remote.read(self.url, self.pos, self.size) if self.pos < self.size else b""
        self.pos += len(out)
        return out
