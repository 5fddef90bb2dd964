"""Which corpus files the --data paths stand for, each once, with its format.

A directory stands for its files of the kinds formats reads (sorted by name, not recursive; plain .json
files are left out as likely configs, compressed ones kept; left_out names the rest, a FIFO or socket
among them). A file that cannot be opened (permission denied) fails resolving, in one line naming it. A
file reached more than once (named twice, a folder and a file in it, a symlink or hard link to another file
read; a URL named twice) is read once, where it first comes, and said so in one line. A file:// (or
local://) URL of this machine's file or folder (file:///abs/path, file://localhost/abs/path,
percent-encoded; a glob too) is that path in all of this, named as given in messages and record ids
(file:///tmp/a.txt:3); one of another host is refused in one line. A local glob the shell left (quoted, or
in LMPIPE_DATA) is expanded as the shell would: its files, sorted, no hidden ones.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from urllib.parse import quote

from lmpipe.producer.formats.changes import snapshot
from lmpipe.producer.formats.hf import hf_files
from lmpipe.producer.formats.kinds import DataFile, classify, read_from_dir, require_extras
from lmpipe.producer.remote import Remote, version
from lmpipe.producer.shards import is_shard_dir
from lmpipe.shared.files import local_path

log = logging.getLogger("lmpipe.producer")
_said_again: set[str] = set()  # files reached more than once, said once per process (forked producers too)
SAID_AGAIN = 3  # duplicate files named in that one line, at most


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


def _local_file(path: Path, given: str | None = None) -> DataFile:
    try:
        st, digest = snapshot(str(path))
    except OSError as exc:  # unreadable (permission denied): said now, by name, not by each producer later
        raise type(exc)(f"corpus file {given or path}: cannot read it ({exc.strerror or exc})") from None

    def peek(a: int, b: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(a)
            return f.read(b - a)

    fmt, compression = classify(path.name, st.st_size, peek)
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
        hf = hf_files(shown, names, lambda name: (path / name).read_text())
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
        fmt, compression = classify(u.rsplit("/", 1)[-1], size, lambda a, b: r.read(u, a, b))
        return DataFile(u, fmt, compression, size, r, version=ver)

    if any(c in url.split("://", 1)[1] for c in "*?["):
        return [remote_file(u, size, ver) for u, size, ver in r.glob(url)]
    info = r.info(url)  # a missing bucket or key: FileNotFoundError naming the URL
    if info["type"] != "directory":
        return [remote_file(url, int(info.get("size") or 0), version(info, r.proto))]
    entries = r.ls(url)
    by_name = {u.rsplit("/", 1)[-1]: (u, size, ver) for u, size, kind, ver in entries if kind == "file"}
    hf = hf_files(url, set(by_name), lambda name: r.read_all(by_name[name][0]).decode())
    if hf is not None:
        return [remote_file(*by_name[name]) for name in hf]
    return [
        remote_file(u, size, ver) for name, (u, size, ver) in sorted(by_name.items()) if read_from_dir(name)
    ]
