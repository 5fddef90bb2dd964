"""File helpers shared by checkpoints, shards and the data a run names."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import unquote_to_bytes

SHARD_META = "meta.json"  # names a shard directory's files and what made them (producer/shards.py)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (checkpoints and shards are GiBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_url(path: str) -> bool:
    return "://" in path


LOCAL_PROTOCOLS = ("file", "local")  # fsspec's names for this machine's files


def local_path(p: str) -> str | None:
    """The local path a --data string names: `p` itself when it is not a URL, the path of a file:// (or
    local://) URL, percent-decoded (file:///tmp/a%20b.txt is /tmp/a b.txt, file://localhost/x is /x); None
    for any other URL. A URL of another host is a ValueError (one line).

    The one place a file:// URL becomes the local file it names: read through fsspec it was a remote object,
    not checked for changes (check_unchanged), not in the content digest, refused as binary by nothing. As
    its path, it is that file everywhere; DataFile.given keeps the URL for messages and record ids."""
    if not is_url(p):
        return p
    scheme, rest = p.split("://", 1)
    if scheme.lower() not in LOCAL_PROTOCOLS:
        return None
    host, slash, path = rest.partition("/")
    if host and host.lower() != "localhost":
        raise ValueError(
            f"{p}: names host {host!r}; a {scheme}:// URL is read only as this machine's file "
            f"({scheme}:///absolute/path or {scheme}://localhost/absolute/path): give the local path itself "
            "(a relative one too), or a URL of the store that serves it (s3://, https://...)"
        )
    return os.fsdecode(unquote_to_bytes(slash + path)) or "/"  # names not UTF-8 too (surrogateescape)
