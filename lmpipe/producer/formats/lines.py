"""The lines of a text or JSONL file, each bounded by --max-line-bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lmpipe.producer.formats.compressed import open_binary
from lmpipe.producer.formats.kinds import DataFile

DRAIN_CHUNK = 1 << 20  # bytes read at a time while skipping an over-long line
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors write at a file's start


CR_HINT = (
    "the file has CR line endings (\\r without \\n, old Mac style) and lines are split on \\n only: convert it, "
    "e.g. tr '\\r' '\\n' < IN > OUT"
)


def _cr_only(head: bytes) -> bool:
    """A file's first line, as read (up to the line limit), holds CR but no LF: CR line endings."""
    return b"\r" in head and b"\n" not in head


def read_lines(
    path: Path | DataFile, max_line_bytes: int, notes: dict[str, bool] | None = None
) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, raw bytes without newline or None when over the limit, full length). A UTF-8 BOM at
    the file's first byte (decompressed) is not content: dropped before line 1 (line numbers and record ids
    are as without it; a resumed reader reads from the start too, so they agree). `notes["cr"]`: set when
    the first line read has CR but no LF (CR line endings: the file is one line)."""
    with open_binary(path) as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1 + (len(BOM) if lineno == 0 else 0))
            if lineno == 0 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw:
                return
            if lineno == 0 and notes is not None and _cr_only(raw):
                notes["cr"] = True
            lineno += 1
            if len(raw) - raw.endswith(b"\n") > max_line_bytes:
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # drain the rest of the line without keeping it
                    raw = f.readline(DRAIN_CHUNK)
                    size += len(raw)
                yield lineno, None, size
                continue
            yield lineno, raw.rstrip(b"\r\n"), len(raw)
