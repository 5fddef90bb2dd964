"""File helpers shared by checkpoints and shards."""

from __future__ import annotations

import hashlib
from pathlib import Path

SHARD_META = "meta.json"  # names a shard directory's files and what made them (producer/shards.py)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (checkpoints and shards are GiBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
