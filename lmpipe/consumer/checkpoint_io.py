"""state.pt written in one pass: serialized by torch.save and hashed as it goes.

A checkpoint's state.pt is GiBs (GPT-2 124M with AdamW: 1.4 GiB). Written the plain way (torch.save, then
fsync, then the sha256 for header.json read back from the file) each byte is touched four times in a row: the
zip writer's CRC32, the write, the flush to disk, the re-read and hash (GPT-2 124M on 2 CPUs: 0.6 s of CRCs,
0.5 s of writing, 0.7 s of fsync, 1.5 s of reading back and hashing; bench/checkpoint_write.py). Here:

- sha256 while writing: every write torch.save makes goes through HashingFile, which feeds the same bytes
  to the file and to the hash; a large write's hash runs in a helper thread while the write itself runs (both
  release the GIL), so the hash costs about nothing beside the write and the file is never read back.
- no zip CRC32 (torch.serialization.set_crc32_options(False), torch >= 2.5): torch.load does not check the
  zip records' CRC32s (torch's documentation of the option: "torch.load will be able to load the file"), and
  lmpipe checks the whole file's sha256 against header.json before torch.load reads a byte of it, so the
  sha256 already guards every byte and a CRC is pure cost. A zip tool (`unzip -t`) would flag the records'
  missing CRCs; no lmpipe reader uses one. Checkpoints written with CRCs load as before: reading is unchanged.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

BUFFER = 1 << 20  # state.pt's file buffer: torch.save's many small writes (zip headers) in few syscalls
_LARGE = 1 << 20  # a write at least this large is hashed in the helper thread while it is written
_crc_lock = threading.Lock()  # torch's CRC option is process-wide: one checkpoint write at a time sets it


class HashingFile:
    """A binary file torch.save writes through: each write goes to `f` and into `sha256`."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.hash_wait = 0.0  # seconds a write waited for its hash after the write itself was done
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")

    def write(self, data: Any) -> int:
        with memoryview(data) as view, view.cast("B") as b:
            n = len(b)
            if n < _LARGE:
                self.sha256.update(b)
                self._f.write(b)
            else:
                hashed = self._pool.submit(self.sha256.update, b)
                try:
                    self._f.write(b)  # larger than the buffer: straight to the file, the GIL released
                finally:
                    # the view is torch's memory, valid only during this call: the hash is done before return
                    t0 = time.perf_counter()
                    hashed.result()
                    self.hash_wait += time.perf_counter() - t0
        self.bytes += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """The helper thread stops (the file stays open: its owner fsyncs and closes it)."""
        self._pool.shutdown(wait=True)


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
