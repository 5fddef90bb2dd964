"""Whether a corpus file is still as the run found it (CorpusChanged when not).

A local file is checked against its size, modification and status-change times and inode when the run
found it, before each pass opens it and after each pass reads it (an Arrow file: before each batch too):
one changed (truncated, appended to, rewritten, replaced) stops the reader with one line (CorpusChanged),
never a shorter epoch passed off as the corpus (a file emptied under --epochs 0 ended a run as if
complete). One of the same size whose times or inode changed (touched, copied over with the same bytes) is
hashed again and compared with the digest taken when it was found (blake2b of its size and content, the
first, middle and last 64 KiB of a file over 256 KiB): the same, it is read on, said once in an info line;
other bytes, it stops the run as any other change. A remote object is checked by its version and size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from lmpipe.producer.formats.kinds import CorpusChanged, DataFile
from lmpipe.producer.remote import version

log = logging.getLogger("lmpipe.producer")
DIGEST_WHOLE = 256 << 10  # a local file this size or smaller is hashed whole when found (and when rechecked)
DIGEST_SAMPLE = 64 << 10  # a larger one: its first, middle and last this many bytes
_recheck = threading.Lock()  # one thread hashes a changed-looking file again; the others then see its answer


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


def snapshot(path: str) -> tuple[os.stat_result, bytes | None]:
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
        st, digest = snapshot(f.path)
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
