"""What a corpus file is: its format and compression, from its name or else its first bytes.

  .txt                      plain text (documents split by --doc-split)
  .jsonl .ndjson .json      JSON lines: {"text": ...} or {"ids": [...]} per line
  + .gz / .zst / .zstd      the same, compressed (gzip or zstandard), decompressed as it streams
  .parquet .pq              Parquet: one record per row, from the text column, row group by row group
  .arrow                    Arrow IPC, stream or file format (what Hugging Face `datasets` writes)
Any other name: by magic number (Parquet, Arrow, gzip and zstd), else text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath

from lmpipe.producer.remote import MissingExtra, Remote

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


DIR_SUFFIXES = (
    ".txt",
    ".jsonl",
    ".ndjson",
    ".parquet",
    ".pq",
    ".arrow",
)  # not .json: configs sit beside data


COMPRESSION = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TABLES = ("parquet", "arrow")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes


class FormatError(ValueError):
    """A file that cannot be read as the format it claims (one line naming the file and what to do)."""


class CorpusChanged(ValueError):
    """A corpus file or object no longer as the run found it: a run's record ids and cursors describe it."""


@dataclass(frozen=True)
class Damaged:
    """Rows of a table that cannot be decoded (a damaged Parquet row group, an Arrow batch that fails its
    checks), read past: one bad record, the rows' ids kept so that the rows after them keep theirs."""

    rows: int
    part: str  # "row group 3", "record batch 2"
    why: str


@dataclass(frozen=True, eq=False)
class DataFile:
    path: str  # a local path or a URL, as messages show it
    fmt: str  # "text" | "jsonl" | "parquet" | "arrow"
    compression: str | None = None  # "gzip" | "zstd" for streamed text/JSONL
    size: int = 0
    remote: Remote | None = None
    inode: tuple[int, int] | None = None  # a local file's (st_dev, st_ino): which paths are the same file
    mtime_ns: int = 0  # a local file's modification time when the run found it
    ctime_ns: int = 0  # and its status-change time: a rewrite that sets the modification time back moves it
    # blake2b of a local file's size and content when found (_content_digest); None: it could not be read
    digest: bytes | None = field(default=None, repr=False)
    # (st_dev, st_ino, st_mtime_ns, st_ctime_ns) it has had since, hashed again and found the same content
    same_content: set[tuple[int, int, int, int]] = field(default_factory=set, repr=False)
    # a local file given as a file:// URL: that URL, as messages and record ids name it (path: its local path)
    given: str | None = None
    # a remote object's version as its store reports it (remote.version: an ETag, an MD5), None if none
    version: str | None = None

    def __str__(self) -> str:
        return self.given or self.path

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _from_name(name: str) -> tuple[str | None, str | None]:
    """(format or None when the name does not say, compression) from a file name."""
    lower = name.lower()
    compression = None
    for ext, kind in COMPRESSION.items():
        if lower.endswith(ext):
            compression, lower = kind, lower[: -len(ext)]
            break
    suffix = PurePosixPath(lower).suffix
    if suffix in (".parquet", ".pq") and compression is None:
        return "parquet", None
    if suffix == ".arrow" and compression is None:
        return "arrow", None
    if suffix in JSONL_SUFFIXES:
        return "jsonl", compression
    if suffix in TEXT_SUFFIXES:
        return "text", compression
    return None, compression


def magic(head: bytes) -> str | None:
    """What a file's first bytes say it is, by magic number: "parquet", "arrow", "gzip", "zstd" or None.
    Text could start with "PAR1" or "ARROW1" too; callers confirm those (Parquet's footer, a NUL byte)."""
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":  # IPC file; IPC stream's first message
        return "arrow"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == ZSTD_MAGIC:
        return "zstd"
    return None


def _from_content(head: bytes, tail: bytes) -> tuple[str | None, str | None]:
    kind = magic(head)
    if kind == "parquet":
        return ("parquet", None) if tail[-4:] == b"PAR1" else (None, None)
    if kind == "arrow":
        return "arrow", None
    return None, kind


def classify(name: str, size: int, peek) -> tuple[str, str | None]:
    fmt, compression = _from_name(name)
    if fmt is None and compression is None and size:
        fmt, compression = _from_content(peek(0, min(size, 8)), peek(max(0, size - 8), size))
    return fmt or "text", compression


def read_from_dir(name: str) -> bool:
    """A directory's corpus files: .json only compressed (x.json.gz is data, as in C4; x.json a config);
    never hidden ones (a Mac's ._a.txt beside a.txt, editors' .swp files)."""
    if name.startswith("."):
        return False
    fmt, compression = _from_name(name)
    lower = name.lower()
    for ext in COMPRESSION:
        if lower.endswith(ext):
            lower = lower[: -len(ext)]
            break
    suffix = PurePosixPath(lower).suffix
    return fmt is not None and (suffix in DIR_SUFFIXES or (suffix == ".json" and compression is not None))


def require_extras(f: DataFile) -> None:
    if f.fmt in TABLES:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MissingExtra(
                f"{f}: reading {f.fmt.capitalize()} needs pyarrow: pip install 'lmpipe[parquet]'"
            ) from None
    if f.compression == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise MissingExtra(f"{f}: reading zstd needs zstandard: pip install 'lmpipe[zstd]'") from None
