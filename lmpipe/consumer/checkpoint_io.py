"""state.pt written in one pass: serialized by torch.save and hashed as it goes.

A checkpoint's state.pt is GiBs (GPT-2 124M with AdamW: 1.4 GiB). Written the plain way (torch.save, then
fsync, then the sha256 for header.json read back from the file) each byte is touched four times in a row: the
zip writer's CRC32, the write, the flush to disk, the re-read and hash (GPT-2 124M on 2 CPUs: 0.6 s of CRCs,
0.5 s of writing, 0.7 s of fsync, 1.5 s of reading back and hashing; bench/checkpoint_write.py). Here:

- sha256 while writing, per block: every write torch.save makes goes through HashingFile, which feeds the same
  bytes to the file and to one sha256 per 2 MiB block of the file; header.json's state_sha256_blocks holds
  the block size and the sha256 of the blocks' digests one after the other (format 4). One sha256 of the
  whole file (state_sha256, formats up to 3) is a single sequential pass, at 1-2 GB/s about as long as the
  write itself; blocks are hashed by helper threads side by side while the write runs (hashlib and the write
  release the GIL; small blocks, so that a record of a few MiB is hashed by several threads), so the hash
  costs little beside the write, the file is never read back, and a resume checks it in parallel too. Any
  changed, missing or added byte changes a block's digest and so the digest of the digests, as it would the
  whole file's sha256. Checkpoints with state_sha256 load as before.
- no zip CRC32 (torch.serialization.set_crc32_options(False), torch >= 2.5): torch.load does not check the
  zip records' CRC32s (torch's documentation of the option: "torch.load will be able to load the file"), and
  lmpipe checks the whole file's sha256 against header.json before torch.load reads a byte of it, so the
  sha256 already guards every byte and a CRC is pure cost. A zip tool (`unzip -t`) would flag the records'
  missing CRCs; no lmpipe reader uses one. Checkpoints written with CRCs load as before: reading is unchanged.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

BUFFER = 1 << 20  # state.pt's file buffer: torch.save's many small writes (zip headers) in few syscalls
_LARGE = 1 << 20  # a write at least this large is hashed by the helper threads while it is written
BLOCK = 2 << 20  # bytes of state.pt per sha256 (header.json's state_sha256_blocks)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# hashing threads: 4 hash 1.4 GiB in about the time of its write; a quarter of the cores at most, the rest
# left to the step loop and the producers (on 2 cores: one, beside the write)
THREADS = max(1, min(4, _cores() // 4))
_crc_lock = threading.Lock()  # torch's CRC option is process-wide: one checkpoint write at a time sets it


class HashingFile:
    """A binary file torch.save writes through: each write goes to `f` and into the sha256 of each BLOCK
    bytes it falls in (`digest()`, once written: the sha256 of those digests)."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._blocks: list[Any] = []  # one sha256 per block, in order
        self.bytes = 0
        self.hash_wait = 0.0  # seconds writes waited for their hashes after the write itself was done
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="checkpoint-hash")

    def write(self, data: Any) -> int:
        with memoryview(data) as view, view.cast("B") as b:
            n = len(b)
            pieces = []  # (block's hash, the bytes of it in this write): one piece per block
            try:
                pos = 0
                while pos < n:
                    at = self.bytes + pos
                    if at // BLOCK == len(self._blocks):
                        self._blocks.append(hashlib.sha256())
                    take = min(n - pos, BLOCK - at % BLOCK)
                    pieces.append((self._blocks[at // BLOCK], b[pos : pos + take]))
                    pos += take
                self._hash_and_write(b, pieces)
            finally:
                for _, piece in pieces:
                    piece.release()
        self.bytes += n
        return n

    def _hash_and_write(self, b: memoryview, pieces: list[tuple[Any, memoryview]]) -> None:
        if len(b) < _LARGE:
            for h, piece in pieces:
                h.update(piece)
            self._f.write(b)
            return
        hashed = [self._pool.submit(h.update, piece) for h, piece in pieces]
        try:
            self._f.write(b)  # larger than the buffer: straight to the file, the GIL released
        finally:
            # the view is torch's memory, valid only during the write call: every hash is done before it returns
            t0 = time.perf_counter()
            for done in hashed:
                done.result()
            self.hash_wait += time.perf_counter() - t0

    def digest(self) -> str:
        return hashlib.sha256(b"".join(h.digest() for h in self._blocks)).hexdigest()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """The helper threads stop (the file stays open: its owner fsyncs and closes it)."""
        self._pool.shutdown(wait=True)


def blocks_sha256(path: Path, block: int) -> str:
    """What HashingFile.digest() gave for a file written with `block`: the sha256 of each `block` bytes, read
    in order and hashed by THREADS threads meanwhile (at most 4 blocks a thread read ahead), then the sha256
    of those digests."""
    top = hashlib.sha256()
    pending: deque[Future[bytes]] = deque()
    with (
        open(path, "rb") as f,
        ThreadPoolExecutor(THREADS) as pool,
    ):  # buffered: read(n) reads n bytes or to EOF
        while chunk := f.read(block):
            pending.append(pool.submit(lambda c: hashlib.sha256(c).digest(), chunk))
            if len(pending) >= 4 * THREADS:
                top.update(pending.popleft().result())
        for p in pending:
            top.update(p.result())
    return top.hexdigest()


def save_state(state: dict[str, Any], out: HashingFile) -> None:
    """torch.save without the zip CRC32s (the module's docstring says why)."""
    import torch  # here, not at the top: the launcher reads checkpoint headers torch-free

    with _crc_lock:
        was = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, out)  # type: ignore[arg-type]  # a file: write and flush are all it calls
        finally:
            torch.serialization.set_crc32_options(was)
