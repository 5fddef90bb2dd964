"""The remote half of a shard set (s3://bucket/shards, any fsspec URL; see remote.py).

Nothing is downloaded whole: meta.json, index and rids files are read at open (16 bytes a document) and
checked, token files by their sizes only (a checksum would read every byte); each document is then one
ranged read, fetched together with the rest of its chunk of the stream (concurrent requests), and its ids
are checked against the vocabulary as they arrive.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lmpipe.producer.remote import Remote
from lmpipe.producer.shard_meta import ShardError, file_names, file_sizes, load_meta
from lmpipe.shared.files import SHARD_META as META


class ShardIndex(Protocol):
    """What RemoteShards reads and fills in of the ShardSet (producer/shards.py) that holds it: named by
    its shape, so that the import runs one way, shards.py -> remote_shards.py."""

    path: Path | str
    meta: dict[str, Any]
    tokens: list[np.ndarray]
    docs: np.ndarray
    rids: np.ndarray


class Pending:
    def __init__(self, owner: RemoteShards):
        self.owner = owner
        self.ids: np.ndarray | None = None
        self.mask: np.ndarray | None = None  # set with ids when the document's shard has a loss mask

    def result(self) -> np.ndarray:
        if self.ids is None:
            self.owner.flush()
        assert self.ids is not None
        return self.ids


class RemoteShards:
    """The remote half of a ShardSet: opens and checks it, then fetches documents in batches."""

    MAX_PENDING = 4096  # documents requested but not fetched yet: fetched early beyond this
    # Reading the bytes between two documents beats another request while gap < bandwidth x latency /
    # concurrency (S3: ~100 MB/s x 30 ms / 128 requests in flight ~ 23 KB); the waste is at most
    # MERGE_GAP per document, 8 MiB for a chunk of 512.
    MERGE_GAP = 16 << 10
    MAX_READ = 16 << 20

    def __init__(self, shards: ShardIndex, remote: Remote, verify_checksums: bool):
        self.shards, self.r = shards, remote
        base = str(shards.path)
        meta_url = f"{base}/{META}"
        shards.meta, self.dtype = load_meta(remote.read_all(meta_url), meta_url)
        m = shards.meta
        self.vocab_size = int(m["vocab_size"])
        sizes = {u.rsplit("/", 1)[-1]: size for u, size, _, _ in remote.ls(base)}
        self.token_urls: list[str] = []
        self.mask_urls: list[str | None] = []
        offsets, rids = [], []
        for k, sh in enumerate(m["shards"]):
            expected = file_sizes(sh, self.dtype)
            arrays = {}
            self.mask_urls.append(None)
            for n in file_names(sh):
                name = sh["files"][n]["name"]
                url = f"{base}/{name}"
                if name not in sizes:
                    raise ShardError(f"{url}: missing")
                if sizes[name] != expected[n]:
                    raise ShardError(
                        f"{url}: {sizes[name]} bytes, meta.json says {expected[n]} (truncated or corrupt)"
                    )
                if n == "tokens":
                    self.token_urls.append(url)
                    continue
                if n == "mask":  # read with the tokens, and checked as they arrive
                    self.mask_urls[k] = url
                    continue
                data = remote.read_all(url) if expected[n] else b""
                if verify_checksums and hashlib.sha256(data).hexdigest() != sh["files"][n]["sha256"]:
                    raise ShardError(f"{url}: checksum mismatch (corrupt file)")
                arrays[n] = np.frombuffer(data, dtype="<i8")
            index = arrays["index"]
            if index[0] != 0 or index[-1] != sh["tokens"] or (np.diff(index) < 0).any():
                raise ShardError(f"{base}/{sh['files']['index']['name']}: offsets are not a valid index")
            offsets.append(np.stack([np.full(sh["documents"], k), index[:-1], index[1:]], axis=1))
            rids.append(arrays["rids"])
        shards.tokens = []
        shards.docs = np.concatenate(offsets) if offsets else np.zeros((0, 3), np.int64)
        shards.rids = np.concatenate(rids) if rids else np.zeros(0, np.int64)
        self.pending: list[tuple[int, Pending]] = []

    def add(self, i: int) -> Pending:
        p = Pending(self)
        self.pending.append((i, p))
        if len(self.pending) >= self.MAX_PENDING:
            self.flush()
        return p

    def flush(self) -> None:
        """Fetch every pending document: per shard file, one batch of concurrent ranged reads, documents
        closer than MERGE_GAP bytes sharing a read (a small shard set comes in a few requests)."""
        pending, self.pending = self.pending, []
        by_shard: dict[int, list[tuple[int, Pending]]] = {}
        for i, p in pending:
            by_shard.setdefault(int(self.shards.docs[i][0]), []).append((i, p))
        isz = self.dtype.itemsize
        for k, items in by_shard.items():
            url = self.token_urls[k]
            spans = [(int(self.shards.docs[i][1]) * isz, int(self.shards.docs[i][2]) * isz) for i, _ in items]
            blocks: list[list] = []  # [start, end, indices into items]
            for j in sorted((j for j, (a, b) in enumerate(spans) if b > a), key=lambda j: spans[j][0]):
                a, b = spans[j]
                if blocks and a - blocks[-1][1] <= self.MERGE_GAP and b - blocks[-1][0] <= self.MAX_READ:
                    blocks[-1][1] = max(blocks[-1][1], b)
                    blocks[-1][2].append(j)
                else:
                    blocks.append([a, b, [j]])
            got: dict[int, bytes] = {}
            for (start, _, js), data in zip(blocks, self.r.read_many(url, [(s, e) for s, e, _ in blocks])):
                for j in js:
                    got[j] = data[spans[j][0] - start : spans[j][1] - start]
            for j, (i, p) in enumerate(items):
                ids = np.frombuffer(got.get(j, b""), dtype=self.dtype)  # an empty document needs no read
                if len(ids) * isz != spans[j][1] - spans[j][0]:
                    raise ShardError(
                        f"{url}: document {i} came back {len(ids) * isz} bytes, not {spans[j][1] - spans[j][0]}"
                    )
                if ids.size and int(ids.max()) >= self.vocab_size:
                    raise ShardError(
                        f"{url}: document {i} has a token id outside the vocabulary of {self.vocab_size}"
                    )
                p.ids = ids
            mask_url = self.mask_urls[k]
            if mask_url is not None:  # the same reads over the uint8 mask file
                mblocks = [(s // isz, e // isz) for s, e, _ in blocks]
                mgot: dict[int, bytes] = {}
                for (start, _end), (_, _, js), data in zip(
                    mblocks, blocks, self.r.read_many(mask_url, mblocks)
                ):
                    for j in js:
                        mgot[j] = data[spans[j][0] // isz - start : spans[j][1] // isz - start]
                for j, (i, p) in enumerate(items):
                    mask = np.frombuffer(mgot.get(j, b""), dtype=np.uint8)
                    if len(mask) != (spans[j][1] - spans[j][0]) // isz or (mask.size and int(mask.max()) > 1):
                        raise ShardError(f"{mask_url}: document {i}'s loss mask is short or not 0/1")
                    p.mask = mask
