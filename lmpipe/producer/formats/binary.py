"""Refusing, at the start, a text or JSONL file that is not text (binary, UTF-16, compressed or a table
under a text name), before any process waits on batches that would be junk."""

from __future__ import annotations

from lmpipe.producer.formats.compressed import open_binary
from lmpipe.producer.formats.kinds import DataFile, FormatError, magic

BINARY_PROBE_BYTES = 8192  # how much of a file is looked at for NUL bytes (what git and grep do)


def refuse_binary(path: DataFile) -> None:
    """Raise ValueError when `path` starts like a binary file (a NUL byte in its first bytes, decompressed:
    a .tar.gz too): no text or JSONL corpus has one, and reading it as text makes thousands of junk
    documents. FormatError for a .gz/.zst that fails to decompress within what is read here."""
    try:
        with open_binary(path) as f:
            head = f.read(BINARY_PROBE_BYTES)
    except FormatError:
        # a .gz/.zst damaged in what this read decompressed (its first MiB: open_binary's buffer), or not
        # compressed as named: refused now, by name (a folder's file too, not only the first one read).
        # Damage further on is found where the producers read it: checking each stream whole here would
        # decompress the corpus once more at every start, in every producer
        raise
    except (OSError, EOFError, ValueError):  # unreadable now: reading it says so, by name
        return
    if _utf16(head):  # Windows editors save "Unicode" text so: every other byte of ASCII text is NUL
        raise ValueError(
            f"{path}: UTF-16 text, not UTF-8; convert it (iconv -f UTF-16 -t UTF-8 IN > OUT) and give that"
        )
    at = head.find(b"\0")
    if path.compression is None and (kind := _misnamed(head, at >= 0)):
        what, rename = kind
        raise ValueError(
            f"{path}: {what} data under a {'JSONL' if path.fmt == 'jsonl' else 'text'} file's name (a file's "
            f"format comes from its name); {rename}"
        )
    if at >= 0:
        raise ValueError(
            f"{path}: binary data (a NUL byte at offset {at}{' once decompressed: an archive?' if path.compression else ''}), "
            "not a text or JSONL corpus; give --data "
            "text, JSONL, Parquet or Arrow files (or .gz/.zst of text/JSONL), or a directory from `lmpipe prepare`"
        )


def _misnamed(head: bytes, has_nul: bool) -> tuple[str, str] | None:
    """(what, what to do) for a compressed file or a table whose name says text: gzip's and zstd's magic
    numbers are not UTF-8, so no text starts with them; "PAR1" and "ARROW1" could, so those also need a NUL."""
    kind = magic(head)
    if kind == "gzip":
        return "gzip", "add .gz to its name (x.txt.gz, x.jsonl.gz)"
    if kind == "zstd":
        return "zstd", "add .zst to its name (x.txt.zst, x.jsonl.zst)"
    if has_nul and kind == "parquet":
        return "Parquet", "name it .parquet"
    if has_nul and kind == "arrow":
        return "Arrow", "name it .arrow"
    return None


def _utf16(head: bytes) -> bool:
    """A UTF-16 byte-order mark, or (without one) NUL in every other byte, as mostly-ASCII UTF-16 has."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return True
    pairs = len(head) // 2
    if pairs < 8:
        return False
    for nul_at in (0, 1):  # big- or little-endian
        if head[nul_at::2][:pairs].count(0) > 0.9 * pairs and head[1 - nul_at :: 2][:pairs].count(0) == 0:
            return True
    return False
