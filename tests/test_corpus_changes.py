"""A corpus file changed under a run, as formats.check_unchanged tells it: a touch (or a copy of the same
bytes over it) is read on, said once; a file of the same size and time put in its place, or rewritten in
place with its time set back, stops the run; a file:// URL of a file read is that file, read once."""

from __future__ import annotations

import logging
import os
import re

import pytest

from lmpipe.producer import formats
from lmpipe.producer.formats import CorpusChanged
from lmpipe.producer.sources import Corpus
from tests.corpora import builtin_docs, write

KINDS = ["jsonl", "jsonl.gz", "parquet", "arrow-file", "arrow"]
READ_ON = "but its content is as the run found it; reading on"


def _corpus(tmp_path, kind: str = "jsonl", n: int = 300):
    """A corpus file of `kind` (tables in batches of 64 rows: an Arrow file is checked before each)."""
    return write(tmp_path / "c", builtin_docs(n), kind, rows_per_group=64)


def _texts(records) -> list[str | None]:
    return [r.text for r in records]


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if READ_ON in r.getMessage()]


def _count_hashes(monkeypatch) -> list[int]:
    """How often a file is hashed from now on (formats._content_digest)."""
    calls = [0]
    digest = getattr(formats, "_content_digest", None)  # (absent before files were hashed)

    def counted(fd: int, size: int) -> bytes:
        calls[0] += 1
        assert digest is not None
        return digest(fd, size)

    monkeypatch.setattr(formats, "_content_digest", counted, raising=False)
    return calls


def _touch(path, by_ns: int = 2_000_000_000) -> None:
    """A new modification time, the same bytes (2 s on: a coarse file system's clock cannot hide it)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + by_ns))


def _same_size_other_bytes(path) -> bytes:
    data = path.read_bytes()
    return bytes(reversed(data)) if data != bytes(reversed(data)) else data[1:] + data[:1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_touched_file_is_read_on_said_once_and_hashed_once(tmp_path, kind, caplog, monkeypatch):
    """`touch` on a corpus file (the same size and bytes, a new time) stopped the run: nothing could
    "restore" it. Its content is hashed again once, found as it was, and the run reads on."""
    path = _corpus(tmp_path, kind)
    c = Corpus([str(path)])
    first = _texts(c.records())
    hashed = _count_hashes(monkeypatch)
    _touch(path)
    with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
        assert _texts(c.records()) == first
        assert _texts(c.records()) == first
    assert hashed[0] == 1, "the new time is remembered, not hashed again at every check"
    said = _said(caplog)
    assert len(said) == 1 and re.fullmatch(
        rf"corpus file {re.escape(str(path))}: modified at .+, {READ_ON}", said[0]
    ), said


@pytest.mark.parametrize("kind", ["jsonl", "arrow-file"])
def test_a_file_touched_during_a_pass_is_read_on(tmp_path, kind, caplog):
    """Touched under a reader (an Arrow file is checked before each batch): the pass goes on to its end."""
    path = _corpus(tmp_path, kind)
    c = Corpus([str(path)])
    first = _texts(c.records())
    records = c.records()
    head = [next(records).text]
    _touch(path)
    with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
        assert head + _texts(records) == first
    assert len(_said(caplog)) == 1


def test_a_large_file_is_told_by_its_first_middle_and_last_bytes(tmp_path, monkeypatch, caplog):
    """A file past DIGEST_WHOLE is hashed by samples: touched, it is read on; a byte of a sample changed
    (the same size, a new time) stops the run as before."""
    monkeypatch.setattr(formats, "DIGEST_WHOLE", 4096, raising=False)
    monkeypatch.setattr(formats, "DIGEST_SAMPLE", 512, raising=False)
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(f"document {i} words words\n\n".encode() for i in range(2000)))
    size = path.stat().st_size
    assert size > 4096
    for at in (0, (size - 512) // 2 + 100, size - 3):  # in the first, middle and last sample
        c = Corpus([str(path)])
        _touch(path)
        with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
            list(c.records())  # read on
        data = bytearray(path.read_bytes())
        data[at] = ord("X") if data[at] != ord("X") else ord("Y")
        path.write_bytes(bytes(data))
        _touch(path)
        with pytest.raises(CorpusChanged, match=rf"\(still {size:,} bytes, but modified at "):
            list(c.records())
    assert len(_said(caplog)) == 3


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow-file"])
def test_a_file_of_the_same_size_and_time_put_in_its_place_stops_the_run(tmp_path, kind):
    """Another file of the same size, its time set to the first's (cp --preserve=timestamps, then a
    rename over it; os.replace of a utime'd file) was read as the run's file, unnoticed."""
    path = _corpus(tmp_path, kind)
    c = Corpus([str(path)])
    list(c.records())
    st = path.stat()
    other = tmp_path / "other"
    other.write_bytes(_same_size_other_bytes(path))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    now = path.stat()
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns) and now.st_ino != st.st_ino
    with pytest.raises(
        CorpusChanged,
        match=rf"^corpus file {re.escape(str(path))} changed during the run \(still {st.st_size:,} bytes, but "
        r"replaced by another file of the same time\); .* restore it or start a new run$",
    ):
        list(c.records())


@pytest.mark.parametrize("time", ["same", "new"])
def test_a_copy_of_the_same_bytes_put_in_its_place_is_read_on(tmp_path, time, caplog):
    """The same bytes in another file moved over it (rsync re-copying, a restore from backup): harmless."""
    path = _corpus(tmp_path)
    c = Corpus([str(path)])
    first = _texts(c.records())
    st = path.stat()
    other = tmp_path / "other"
    other.write_bytes(path.read_bytes())
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if time == "same" else 2_000_000_000)))
    os.replace(other, path)
    with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
        assert _texts(c.records()) == first
    said = _said(caplog)
    assert len(said) == 1 and said[0].startswith(f"corpus file {path}: replaced by another file "), said


def test_a_file_rewritten_in_place_with_its_time_set_back_stops_the_run(tmp_path):
    """The same inode, size and modification time, other bytes (written, then os.utime back): its
    status-change time, which nothing but the clock sets, tells it."""
    path = _corpus(tmp_path)
    c = Corpus([str(path)])
    list(c.records())
    st = path.stat()
    other = _same_size_other_bytes(path)
    for _ in range(100_000):  # until the status-change clock moves past the file's (coarse: a tick or two)
        with open(path, "r+b") as f:  # the same inode
            f.write(other)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if path.stat().st_ctime_ns != st.st_ctime_ns:
            break
    else:
        pytest.skip("this file system's status-change time does not move")
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    with pytest.raises(
        CorpusChanged, match=rf"\(still {st.st_size:,} bytes, but rewritten at .+ \(its time kept\)\)"
    ):
        list(c.records())


def test_a_file_url_and_the_path_of_its_file_are_read_once(tmp_path, caplog):
    """`--data a.txt file:///.../a.txt` (or a file:// folder holding a file named too) read the file twice
    an epoch: the URL was told apart from the path by its text alone."""
    pytest.importorskip("fsspec")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("alpha one\n\nalpha two\n")
    (d / "b.txt").write_text("beta\n")
    a, b, url_a, url_b = str(d / "a.txt"), str(d / "b.txt"), f"file://{d}/a.txt", f"file://{d}/b.txt"
    alpha, beta = ["alpha one", "alpha two"], ["beta"]
    for given, kept, texts, again in [
        ([a, url_a], [a], alpha, f"{a} (again as {url_a})"),
        ([url_a, a], [url_a], alpha, f"{url_a} (again as {a})"),
        ([b, f"file://{d}"], [b, url_a], beta + alpha, f"{b} (again as {url_b})"),  # a folder's listing
    ]:
        caplog.clear()
        c = Corpus(given)
        assert [str(p) for p in c.paths] == kept
        assert [r.text for r in c.records()] == texts
        said = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
        assert said == [
            f"--data reaches 1 file(s) more than once; each is read once, where it first comes: {again}"
        ], given
