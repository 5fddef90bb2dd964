"""A text or JSONL file's bytes: local or remote, gzip or zstd decompressed as they stream.

A stream that cannot be decoded (truncated, corrupt) stops the reader with one FormatError naming the file
and the bytes decompressed before the damage: re-download or re-create it (`lmpipe prepare` reads every
byte). A .gz or .zst that does not start with its format's magic number (text named .zst) is said to be not
gzip or zstd data instead.
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from lmpipe.producer.formats.changes import check_unchanged
from lmpipe.producer.formats.kinds import ZSTD_MAGIC, DataFile, FormatError
from lmpipe.producer.remote import BLOCK, RangeReader, RemoteError


def _open_raw(f: DataFile) -> BinaryIO:
    if f.remote is None:
        return open(f.path, "rb")  # noqa: SIM115 - the caller closes it
    return io.BufferedReader(RangeReader(f.remote, f.path, f.size), BLOCK)


class _Zstd(io.RawIOBase):
    """zstd frames, one after another, decompressed as read; a frame cut short is an error (python-zstandard's
    stream_reader would end quietly, passing off a truncated file as a shorter one)."""

    CHUNK = 1 << 16  # compressed bytes fed at a time: bounds what one call decompresses

    def __init__(self, raw: BinaryIO):
        super().__init__()
        import zstandard

        self.raw = raw
        self.dctx = zstandard.ZstdDecompressor()
        self.obj = self.dctx.decompressobj()
        self.in_frame = False
        self.buf = b""
        self.rest = (
            b""  # compressed bytes read but not yet fed: a frame's, after the frames before it gave out
        )

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.buf:
            data, self.rest = self.rest or self.raw.read(self.CHUNK), b""
            if not data:
                if self.in_frame:
                    raise EOFError("zstd stream ended inside a frame")
                return 0
            out: list[bytes] = []
            while data:
                if not self.in_frame:  # a frame starts here
                    if out:  # what the frames before it gave comes first, as an error in it cannot take it
                        self.rest = data
                        break
                    data = self._frame_start(data)  # its magic number first
                if self.obj.eof:
                    self.obj = self.dctx.decompressobj()
                out.append(self.obj.decompress(data))
                self.in_frame = not self.obj.eof
                data = self.obj.unused_data if self.obj.eof else b""
            self.buf = b"".join(out)
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n

    def _frame_start(self, data: bytes) -> bytes:
        """`data`, which starts a frame, with at least its 4 bytes of magic number (read on if cut there):
        NotCompressed if they are not a zstd frame's or a skippable frame's (0x184D2A5?), as gzip says
        "Not a gzipped file" (zstandard would say "Unknown frame descriptor")."""
        while len(data) < 4 and (more := self.raw.read(4 - len(data))):
            data += more
        if data[:4] != ZSTD_MAGIC and not (data[1:4] == b"\x2a\x4d\x18" and data[0] & 0xF0 == 0x50):
            raise NotCompressed(f"Not a zstd file ({data[:4]!r})")
        return data

    def close(self) -> None:
        self.raw.close()
        super().close()


class NotCompressed(OSError):
    """A zstd stream's frame does not start with zstd's magic number (gzip.BadGzipFile for gzip)."""


class _Checked(io.RawIOBase):
    """A decompressing stream whose decoding errors become one FormatError naming the file."""

    def __init__(self, inner: Any, raw: BinaryIO, f: DataFile):  # inner: a decompressor with readinto
        super().__init__()
        self.inner, self.raw, self.f = inner, raw, f
        self.done = 0  # decompressed bytes so far

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        # `b` is filled a decompressed chunk at a time (read1), each counted as it comes: GzipFile.readinto
        # fills all of `b` and drops what it decompressed when a later chunk fails, and `b` is a 1 MiB
        # buffer (open_binary), so the count said in the error was short by up to that (0 for a file whose
        # damage is in its first MiB)
        view, n = memoryview(b).cast("B"), 0
        try:
            while n < len(view):
                k = self._read1(view[n:])
                if not k:
                    break
                n += k
                self.done += k
        except RemoteError:
            raise
        except (EOFError, zlib.error, gzip.BadGzipFile, NotCompressed) as exc:
            raise self._error(exc) from None
        except Exception as exc:
            if type(exc).__name__ != "ZstdError":
                raise
            raise self._error(exc) from None
        return n

    def _read1(self, b) -> int:
        """One decompressed chunk into `b` (GzipFile's readinto1; _Zstd's readinto gives one)."""
        return (self.inner.readinto1 if hasattr(self.inner, "readinto1") else self.inner.readinto)(b)

    def _error(self, exc: Exception) -> FormatError:
        check_unchanged(self.f)  # a file cut short since the start is not a corrupt one
        what = self.f.compression
        if (
            self.done == 0
            and isinstance(exc, (gzip.BadGzipFile, NotCompressed))
            and str(exc).startswith("Not a")
        ):
            # no magic number at its start: not damaged, not compressed as its name says (text named .zst)
            return FormatError(
                f"{self.f}: not {what} data, though named {PurePosixPath(str(self.f)).suffix} ({exc}); a "
                "file's format comes from its name: rename it to what it is, or re-download or re-compress it"
            )
        return FormatError(
            # the bytes decompressed before the error, all of them (a decompressor's call that fails keeps
            # none of its output: for corrupt data, the damage is in the next compressed block)
            f"{self.f}: {what} data is truncated or corrupt past its first {self.done:,} "
            f"decompressed bytes ({exc}); re-download or re-compress the file"
        )

    def close(self) -> None:
        self.inner.close()
        self.raw.close()
        super().close()


def open_binary(f: DataFile | Path | str) -> BinaryIO:
    """A text or JSONL file's bytes, decompressed, local or remote, with readline()."""
    if not isinstance(f, DataFile):
        return open(f, "rb")  # noqa: SIM115 - the caller closes it
    raw = _open_raw(f)
    if f.compression is None:
        return raw
    inner: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb") if f.compression == "gzip" else _Zstd(raw)  # type: ignore[assignment]
    return io.BufferedReader(_Checked(inner, raw, f), 1 << 20)
