"""Which corpus files a `--data` path stands for, what format each is in, and readers for the binary ones.

A file's format comes from its name:
  .txt                      plain text (documents split by --doc-split)
  .jsonl .ndjson .json      JSON lines: {"text": ...} or {"ids": [...]} per line
  + .gz / .zst / .zstd      the same, compressed (gzip or zstandard), decompressed as it streams
  .parquet .pq              Parquet: one record per row, from the text column, row group by row group
  .arrow                    Arrow IPC, stream or file format (what Hugging Face `datasets` writes)
and, for any other name, from its first bytes (Parquet, Arrow, gzip and zstd magic numbers), else text.
A directory stands for its files of those kinds (sorted by name, not recursive; plain .json files are left
out as likely configs, compressed ones kept; left_out names the rest, a FIFO or socket among them). A file
that cannot be opened (permission denied) fails resolving, in one line naming it. A file reached more than once (named twice, a folder and a
file in it, a symlink or hard link to another file read; a URL named twice) is read once, where it first
comes, and said so in one line. A directory written by Hugging Face `save_to_disk`
(state.json beside data-*.arrow) stands for its Arrow files in state.json's order, read with pyarrow
alone: the `datasets` package is not needed. A DatasetDict folder (dataset_dict.json) is refused with
the splits named: pass one split's folder.

Tables (Parquet, Arrow) are read from the column named `text_column` ("text" by default: string or
binary), or, when there is no "text" column, from pre-tokenized "ids" or "input_ids" (lists of integers).
Row r of a table is one record; a null, empty, non-UTF-8 or out-of-vocabulary row is a bad record named
`FILE:row R` (R counts from 0 in that file, as `dataset[R]` does), counted and skipped like a bad line.
A file that cannot be decoded at all (a truncated gzip or zstd stream, a damaged Parquet file) stops the
reader with one line naming the file: re-download or re-create it (`lmpipe prepare` reads every byte). A
stream's line counts the bytes decompressed before the damage; a .gz or .zst that does not start with its
format's magic number (text named .zst) is said to be not gzip or zstd data instead.
A local file is checked against its size, modification and status-change times and inode when the run
found it, before each pass opens it and after each pass reads it (an Arrow file: before each batch too):
one changed (truncated, appended to, rewritten, replaced) stops the reader with one line (CorpusChanged),
never a shorter epoch passed off as the corpus (a file emptied under --epochs 0 ended a run as if
complete). One of the same size whose times or inode changed (touched, copied over with the same bytes) is
hashed again and compared with the digest taken when it was found (blake2b of its size and content, the
first, middle and last 64 KiB of a file over 256 KiB): the same, it is read on, said once in an info line;
other bytes, it stops the run as any other change. A file:// (or local://) URL of this machine's file or
folder (file:///abs/path, file://localhost/abs/path, percent-encoded; a glob too) is that path in all of
this (found, checked, hashed, refused as binary, "reached more than once"), named as given in messages and
record ids (file:///tmp/a.txt:3); one of another host is refused in one line. A local glob the shell left
(quoted, or in LMPIPE_DATA) is expanded as the shell would: its files, sorted, no hidden ones.

pyarrow (lmpipe[parquet]) and zstandard (lmpipe[zstd]) are needed only for the files that use them.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import logging
import os
import stat
import threading
import time
import zlib
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import quote

import numpy as np

from lmpipe.producer.remote import BLOCK, MissingExtra, RangeReader, Remote, RemoteError, version
from lmpipe.producer.shards import is_shard_dir
from lmpipe.shared.files import local_path

log = logging.getLogger("lmpipe.producer")

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
IDS_COLUMNS = ("ids", "input_ids")
MASK_COLUMNS = ("labels", "loss_mask")  # what a tokenized fine-tuning table marks its trained tokens with
_said_unmasked: set[str] = set()
_said_unread: set[str] = set()  # files whose text column is read over ids or prompt columns, said once
ROWS_PER_BATCH = 4096  # rows decoded at a time from a Parquet row group
_said_again: set[str] = set()  # files reached more than once, said once per process (forked producers too)
SAID_AGAIN = 3  # duplicate files named in that one line, at most
DIGEST_WHOLE = 256 << 10  # a local file this size or smaller is hashed whole when found (and when rechecked)
DIGEST_SAMPLE = 64 << 10  # a larger one: its first, middle and last this many bytes
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes
_recheck = threading.Lock()  # one thread hashes a changed-looking file again; the others then see its answer


class FormatError(ValueError):
    """A file that cannot be read as the format it claims (one line naming the file and what to do)."""


class CorpusChanged(ValueError):
    """A corpus file or object no longer as the run found it: a run's record ids and cursors describe it."""


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


def _classify(name: str, size: int, peek) -> tuple[str, str | None]:
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


# -- resolving --data paths -----------------------------------------------------------------------------


def resolve(paths: list[str]) -> list[DataFile]:
    """The corpus files `paths` stand for, in order, each with its format; missing extras fail here."""
    out: list[DataFile] = []
    for p in paths:
        local = local_path(p)
        out += _resolve_remote(p) if local is None else _resolve_local(local, None if local == p else p)
    if paths and not out:
        raise FileNotFoundError(
            f"no corpus files in {', '.join(paths)} (.txt, .jsonl, .parquet, .arrow, or .gz/.zst of text/JSONL)"
        )
    out = _read_once(out)
    for f in out:
        require_extras(f)
    return out


def _read_once(files: list[DataFile]) -> list[DataFile]:
    """Each file once, where it first comes: a local file by its (device, inode), so another path to it (a
    symlink, a hard link, ./a.txt, a file:// URL of it) is the same file; any other URL by itself. Read
    again, it would be trained twice an epoch, unsaid. Its first place keeps the record ids of the files
    before the others."""
    first: dict[object, DataFile] = {}
    again: dict[DataFile, list[str]] = {}
    out = []
    for f in files:
        # with its size and time: a file system that numbers inodes loosely cannot make two files one
        key = (f.inode, f.size, f.mtime_ns) if f.inode is not None else f.path
        kept = first.setdefault(key, f)
        if kept is f:
            out.append(f)
        else:
            again.setdefault(kept, []).append(str(f))
    said = [f"{f} (again as {', '.join(paths)})" for f, paths in again.items()]
    if said and "; ".join(said) not in _said_again:  # said by `lmpipe run` before it forks its producers
        _said_again.add("; ".join(said))
        more = f"; and {len(said) - SAID_AGAIN} more" if len(said) > SAID_AGAIN else ""
        log.warning("--data reaches %d file(s) more than once; each is read once, where it first comes: %s%s",
                    len(said), "; ".join(said[:SAID_AGAIN]), more)  # fmt: skip
    return out


def _content_digest(fd: int, size: int) -> bytes:
    """blake2b of a file's size and bytes: all of them up to DIGEST_WHOLE, else its first, middle and last
    DIGEST_SAMPLE (a touch, a copy of the same bytes, a shuffled or regenerated table are told apart from
    the file as found for a few reads, not a pass over it)."""
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    if size <= DIGEST_WHOLE:
        spans = [(0, size)]
    else:
        spans = [
            (0, DIGEST_SAMPLE),
            ((size - DIGEST_SAMPLE) // 2, DIGEST_SAMPLE),
            (size - DIGEST_SAMPLE, DIGEST_SAMPLE),
        ]
    for at, n in spans:
        while n > 0:
            data = os.pread(fd, min(n, 1 << 20), at)
            if not data:  # cut short while hashed: the stat after it says so
                break
            h.update(data)
            at, n = at + len(data), n - len(data)
    return h.digest()


def _state(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _snapshot(path: str) -> tuple[os.stat_result, bytes | None]:
    """A file's stat and content digest, of the same bytes: hashed again while it changes under the hash
    (no digest after three tries, nor for what is not a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in its place does not block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return st, None
        for _ in range(3):
            digest = _content_digest(fd, st.st_size)
            after = os.fstat(fd)
            if _state(after) == _state(st) and after.st_size == st.st_size:
                return st, digest
            st = after
        return st, None
    finally:
        os.close(fd)


def _local_file(path: Path, given: str | None = None) -> DataFile:
    try:
        st, digest = _snapshot(str(path))
    except OSError as exc:  # unreadable (permission denied): said now, by name, not by each producer later
        raise type(exc)(f"corpus file {given or path}: cannot read it ({exc.strerror or exc})") from None

    def peek(a: int, b: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(a)
            return f.read(b - a)

    fmt, compression = _classify(path.name, st.st_size, peek)
    return DataFile(
        str(path),
        fmt,
        compression,
        st.st_size,
        inode=(st.st_dev, st.st_ino),
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
        digest=digest,
        given=given,
    )


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def check_unchanged(f: DataFile, routine: bool = False) -> None:
    """Raise CorpusChanged when `f` is not as the run found it: record ids and cursors number its records as
    they were, and an emptied file read as one would end the epoch. A local file's size, times and inode are
    compared (a stat); a file of the same size whose times or inode changed is hashed again (once per new
    state) and read on if its content is as found. An object's version and size are asked of its store (a
    HEAD request), except on the `routine` checks of the read path: objects are asked about all at once at
    each pass's start and end instead (check_objects)."""
    if f.inode is None:  # a URL
        if f.remote is not None and f.version is not None and not routine:
            _check_object(f)
        return
    try:
        st = os.stat(f.path)
    except FileNotFoundError:
        what = "deleted or moved away"
    else:
        if stat.S_ISDIR(st.st_mode):
            what = "now a directory"
        elif not stat.S_ISREG(st.st_mode):
            what = "no longer a regular file"
        elif st.st_size != f.size:
            what = f"{f.size:,} -> {st.st_size:,} bytes"
        elif _state(st) == (*f.inode, f.mtime_ns, f.ctime_ns) or _state(st) in f.same_content:
            return
        else:
            with _recheck:
                changed = _changed_content(f)
            if changed is None:
                return
            what = changed
    raise CorpusChanged(
        f"corpus file {f} changed during the run ({what}); the run cannot go on reading it as it was: "
        "restore it or start a new run"
    )


def check_objects(files: list[DataFile], in_flight: int = 16) -> None:
    """check_unchanged for every remote object of `files` at once, `in_flight` HEAD requests at a time (at a
    pass's start and end: one after another, a round trip per object would cost about as much as reading a
    small object)."""
    objects = [f for f in files if f.inode is None and f.remote is not None and f.version is not None]
    if len(objects) < 2:
        for f in objects:
            _check_object(f)
        return
    pool = ThreadPoolExecutor(min(in_flight, len(objects)), thread_name_prefix="lmpipe-head")
    try:
        for _ in pool.map(_check_object, objects):  # the first change, in corpus order
            pass
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_object(f: DataFile) -> None:
    """CorpusChanged when object `f` no longer has the version and size its store reported when found."""
    assert f.remote is not None
    key = f.remote.key(f.path)
    f.remote.fs.invalidate_cache(key)  # a filesystem's listing cache would answer with the version it found
    try:
        info = f.remote.info(f.path)
    except FileNotFoundError:
        what = "deleted"
    else:
        size, now = int(info.get("size") or 0), version(info, f.remote.proto)
        if size == f.size and now == f.version:
            return
        what = f"{f.size:,} -> {size:,} bytes" if size != f.size else f"rewritten: {f.version} -> {now}"
    raise CorpusChanged(
        f"corpus object {f} changed during the run ({what}); the run cannot go on reading it as it was: "
        "restore it or start a new run"
    )


def _changed_content(f: DataFile) -> str | None:
    """How local file `f`, of its size but not its times or inode when found, changed; None if its
    content is as found, as far as its digest tells (then its new state is remembered, and said once)."""
    try:
        st, digest = _snapshot(f.path)
    except FileNotFoundError:
        return "deleted or moved away"
    except OSError as exc:
        return f"no longer readable: {exc.strerror or exc}"
    state = _state(st)
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file"
    if st.st_size != f.size:
        return f"{f.size:,} -> {st.st_size:,} bytes"
    if state in f.same_content:  # another thread hashed it while this one waited
        return None
    same = digest is not None and digest == f.digest
    if (st.st_dev, st.st_ino) != f.inode:
        how = "replaced by another file" + (
            f" modified at {_when(st.st_mtime_ns)}" if st.st_mtime_ns != f.mtime_ns else " of the same time"
        )
    elif st.st_mtime_ns != f.mtime_ns:
        how = f"modified at {_when(st.st_mtime_ns)}"
    else:  # only its status-change time: written (or its metadata changed), its modification time kept
        how = f"{'its status changed' if same else 'rewritten'} at {_when(st.st_ctime_ns)} (its time kept)"
    if not same:
        return f"still {f.size:,} bytes, but {how}"
    f.same_content.add(state)
    log.info("corpus file %s: %s, but %s; reading on", f, how, _as_found(f.size))
    return None


def _as_found(size: int) -> str:
    """What a digest that matches says of a file of `size` (_content_digest): all of it, or its samples."""
    if size <= DIGEST_WHOLE:
        return "its content is as the run found it"
    kib = f"{DIGEST_SAMPLE >> 10} KiB" if DIGEST_SAMPLE % 1024 == 0 else f"{DIGEST_SAMPLE:,} bytes"
    return (
        f"its sampled parts (first, middle and last {kib}; the rest is not compared) "
        "are as the run found them"
    )


def _resolve_local(p: str, url: str | None = None) -> list[DataFile]:
    """The files of local path `p`; `url`: the file:// URL it was given as (local_path), which names them
    (a folder's files as `url`/name, a glob's as file:// URLs: a file:// glob is expanded as fsspec did)."""
    path, shown = Path(p), url or p

    def named(q: Path) -> str | None:
        return None if url is None else f"{url.rstrip('/')}/{quote(os.fsencode(q.name))}"

    if url is not None and any(c in url.split("://", 1)[1] for c in "*?["):
        scheme, rest = url.split("://", 1)
        prefix = f"{scheme}://{rest.partition('/')[0]}"  # file:// or file://localhost, as given
        found = sorted(glob.glob(p, recursive=True, include_hidden=True))
        return [_local_file(Path(q), prefix + quote(os.fsencode(q))) for q in found if os.path.isfile(q)]
    if path.is_dir():
        names = {q.name for q in path.iterdir()}
        hf = _hf_dataset(shown, names, lambda name: (path / name).read_text())
        if hf is not None:
            return [_local_file(path / name, named(path / name)) for name in hf]
        return [
            _local_file(q, named(q)) for q in sorted(path.iterdir()) if q.is_file() and read_from_dir(q.name)
        ]
    if path.is_file():
        return [_local_file(path, url and url.rstrip("/"))]
    if url is None and not path.exists() and any(c in p for c in "*?["):
        # a glob the shell did not expand (quoted, or from LMPIPE_DATA): expanded as the shell would, in order
        found = sorted(q for q in glob.glob(p, recursive=True) if os.path.isfile(q))
        if not found:
            raise FileNotFoundError(f"corpus path {p} matches no file")
        return [_local_file(Path(q)) for q in found]
    if path.exists():  # /dev/null, a FIFO, a socket: nothing a corpus can be read from twice
        raise ValueError(f"corpus path {shown} is not a regular file or a directory")
    if path.is_symlink():
        raise FileNotFoundError(
            f"corpus path {shown} is a symbolic link to nothing (its target is missing, or a loop)"
        )
    raise FileNotFoundError(f"corpus file not found: {shown}")


def local_folder(p: str) -> Path | None:
    """The local directory a --data string names (a path, or a file:// URL of it); None for a file, a
    store's URL, or another host's file:// URL (resolving the corpus says why that one is refused)."""
    try:
        local = local_path(p)
    except ValueError:
        return None
    return Path(local) if local is not None and Path(local).is_dir() else None


def left_out(paths: list[str]) -> list[str]:
    """What the local directories of `paths` hold that the corpus leaves out: files by their names (a.bin,
    notes.json, hidden ones), subfolders ("en/": directories are read one level deep), symbolic links to
    nothing, and what is not a regular file (a FIFO, a socket, a device). Said once at the start, since a file given by itself is read whatever its name."""
    out = []
    for p in paths:
        path = local_folder(p)
        entries = sorted(path.iterdir()) if path is not None else []
        if (
            not entries
            or {q.name for q in entries} & {"state.json", "dataset_dict.json"}
            or is_shard_dir(str(path))
        ):
            continue  # a file, a URL, a Hugging Face folder (read by its state.json), prepared shards
        out += [str(q) for q in entries if q.is_file() and not read_from_dir(q.name)]
        out += [f"{q}/" for q in entries if q.is_dir()]
        out += [f"{q} (a link to nothing)" for q in entries if q.is_symlink() and not q.exists()]
        # a FIFO, a socket, a device: nothing a corpus can be read from twice (given by itself, refused)
        out += [
            f"{q} (not a regular file)" for q in entries if q.exists() and not (q.is_file() or q.is_dir())
        ]
    return out


def _resolve_remote(url: str) -> list[DataFile]:
    r = Remote(url)
    url = url.rstrip("/")

    def remote_file(u: str, size: int, ver: str | None) -> DataFile:
        fmt, compression = _classify(u.rsplit("/", 1)[-1], size, lambda a, b: r.read(u, a, b))
        return DataFile(u, fmt, compression, size, r, version=ver)

    if any(c in url.split("://", 1)[1] for c in "*?["):
        return [remote_file(u, size, ver) for u, size, ver in r.glob(url)]
    info = r.info(url)  # a missing bucket or key: FileNotFoundError naming the URL
    if info["type"] != "directory":
        return [remote_file(url, int(info.get("size") or 0), version(info, r.proto))]
    entries = r.ls(url)
    by_name = {u.rsplit("/", 1)[-1]: (u, size, ver) for u, size, kind, ver in entries if kind == "file"}
    hf = _hf_dataset(url, set(by_name), lambda name: r.read_all(by_name[name][0]).decode())
    if hf is not None:
        return [remote_file(*by_name[name]) for name in hf]
    return [
        remote_file(u, size, ver) for name, (u, size, ver) in sorted(by_name.items()) if read_from_dir(name)
    ]


def _hf_dataset(where: str, names: set[str], read) -> list[str] | None:
    """Arrow file names of a Hugging Face `save_to_disk` folder in order, or None if it is not one."""
    if "dataset_dict.json" in names:
        try:
            splits = json.loads(read("dataset_dict.json")).get("splits", [])
        except (ValueError, AttributeError):
            splits = []
        raise FormatError(
            f"{where} is a Hugging Face DatasetDict (splits: {', '.join(map(str, splits)) or '?'}); "
            f"pass one split's folder, e.g. {where.rstrip('/')}/{splits[0] if splits else 'train'}"
        )
    if "state.json" not in names:
        return None
    try:
        files = [entry["filename"] for entry in json.loads(read("state.json"))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{where}/state.json: not a Hugging Face dataset state ({exc})") from None
    missing = [f for f in files if f not in names]
    if missing:
        raise FormatError(f"{where}: state.json lists {', '.join(missing)}, which is missing")
    return files


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


# -- streams for text and JSONL --------------------------------------------------------------------------


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


# -- tables: Parquet and Arrow ------------------------------------------------------------------------------


def _column(f: DataFile, schema: Any, text_column: str) -> tuple[str, str]:
    """(column name, kind): kind is "str", "bytes" or "ids"."""
    import pyarrow as pa

    names = list(schema.names)
    candidates = [text_column] + (list(IDS_COLUMNS) if text_column == "text" else [])
    name = next((c for c in candidates if c in names), None)
    if name is None:
        hint = (
            "; prompt/completion records (loss masks) are read from JSONL only: write the table as JSON "
            'Lines, one {"prompt": ..., "completion": ...} object per row'
            if {"prompt", "completion"} <= set(names) and text_column == "text"
            else ""
        )
        raise FormatError(
            f"{f}: no column {text_column!r} (columns: {', '.join(names)}); name the text column "
            f"(--text-column){hint}"
        )
    unread = [c for c in (*IDS_COLUMNS, "prompt", "completion") if c in names and c != name]
    if name == text_column and unread and str(f) not in _said_unread:
        _said_unread.add(str(f))
        ids = next((c for c in unread if c in IDS_COLUMNS), None)
        log.warning("%s: column %r is tokenized; %s not read%s", f, name, ", ".join(map(repr, unread)),
                    f" (--text-column {ids} trains the ids as they are)" if ids else "")  # fmt: skip
    masks = [c for c in MASK_COLUMNS if c in names]
    if masks and name in IDS_COLUMNS and str(f) not in _said_unmasked:
        _said_unmasked.add(str(f))  # once per file and process: files are reopened every epoch
        log.warning(
            "%s: column %r is not read: every token of %r is trained (loss masks come from JSONL records "
            "with ids and loss_mask)",
            f,
            masks[0],
            name,
        )
    t = schema.field(name).type
    if pa.types.is_dictionary(t):  # pandas' category columns: the kind of their values (_rows decodes them)
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view":
        return name, "str"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or str(t) == "binary_view":
        return name, "bytes"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return name, "ids"
    raise FormatError(
        f"{f}: column {name!r} is {t}, not text (string/binary) or token ids (list of integers)"
    )


def _rows(col: Any, kind: str, first: int, worker: int, num_workers: int, row0: int, f: DataFile,
          vocab_size: int | None, make) -> Iterator:  # fmt: skip
    """Records of the rows of `col` this worker owns; row i of `col` has record id first + i."""
    import pyarrow as pa

    start = (worker - first) % num_workers
    if start >= len(col):
        return
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if num_workers > 1:  # materialize only this worker's rows
        col = col.take(pa.array(np.arange(start, len(col), num_workers)))
    values: list[Any]
    if kind == "str":
        try:
            values = col.to_pylist()
        except UnicodeDecodeError:  # the file holds invalid UTF-8 in a string column: row by row
            as_bytes = {"large_string": pa.large_binary(), "string_view": pa.binary_view()}
            values = col.view(as_bytes.get(str(col.type), pa.binary())).to_pylist()
            kind = "bytes"
    else:
        values = col.to_pylist()
    limit = vocab_size or (1 << 31)
    for j, v in enumerate(values):
        i = start + j * num_workers
        rec = make(rid=first + i, where=f"{f}:row {row0 + i}")
        if v is None:
            rec.bad = ("missing_text", f"{'ids' if kind == 'ids' else 'text'} is null")
        elif kind == "ids":
            try:  # a null inside the list, or an unsigned id past int64, is this row's problem only
                ids = np.asarray(v, dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                rec.bad = ("bad_ids", f"ids must be integers in [0, {limit}), not {str(v)[:60]}")
                yield rec
                continue
            if not ids.size:
                rec.bad = ("empty", "empty ids")
            elif ids.min() < 0 or ids.max() >= limit:
                rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
            else:
                rec.ids = ids
        else:
            if kind == "bytes":
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError as exc:
                    rec.bad = ("invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
                    yield rec
                    continue
            rec.text = v
            if not v.strip():
                rec.bad = ("empty", "empty text")
        yield rec


def _parquet_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq

    source = f.path if f.remote is None else RangeReader(f.remote, f.path, f.size)
    pf = pq.ParquetFile(source, pre_buffer=False)  # pre-buffering reads every row group up front
    name, kind = _column(f, pf.schema_arrow, text_column)
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=[name], use_threads=False):
        yield batch.column(0), kind


def _arrow_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str]]:
    import pyarrow as pa

    if f.remote is None:
        source = pa.memory_map(f.path)
    else:  # IPC streams are read message by message: buffer, so each message is not its own request
        source = io.BufferedReader(RangeReader(f.remote, f.path, f.size), BLOCK)
    with source:
        head = source.read(6)
        source.seek(0)
        # checked before each batch is read: a page of the memory map that a truncation cut off kills the
        # process (SIGBUS) where this can say why
        if head == b"ARROW1":
            reader = pa.ipc.open_file(source)
            name, kind = _column(f, reader.schema, text_column)
            for k in range(reader.num_record_batches):
                check_unchanged(f, routine=True)
                yield reader.get_batch(k).column(name), kind
        else:
            stream = pa.ipc.open_stream(source)
            name, kind = _column(f, stream.schema, text_column)
            while True:
                check_unchanged(f, routine=True)
                try:
                    batch = stream.read_next_batch()
                except StopIteration:
                    return
                yield batch.column(name), kind


def table_records(f: DataFile, first_rid: int, worker: int, num_workers: int, *, text_column: str,
                  vocab_size: int | None, make) -> Generator[Any, None, int]:  # fmt: skip
    """Records of a Parquet or Arrow file that this worker owns (`make` builds a Record); returns the
    record id after the file's last row."""
    import pyarrow as pa

    batches = _parquet_batches(f, text_column) if f.fmt == "parquet" else _arrow_batches(f, text_column)
    row = 0
    try:
        for col, kind in batches:
            yield from _rows(col, kind, first_rid + row, worker, num_workers, row, f, vocab_size, make)
            row += len(col)
    except pa.ArrowException as exc:
        if isinstance(exc, RemoteError):
            raise
        check_unchanged(f)  # a file rewritten since the start is not a damaged one
        raise FormatError(
            f"{f}: unreadable {f.fmt.capitalize()} data after row {row} ({' '.join(str(exc).split())}); "
            "re-download or re-create the file"
        ) from None
    check_unchanged(f, routine=True)  # the whole pass read the file as it was
    return first_rid + row
