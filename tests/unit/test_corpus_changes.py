"""A corpus file changed under a run, as formats.check_unchanged tells it: a touch (or a copy of the same
bytes over it) is read on, said once; a file of the same size and time put in its place, or rewritten in
place with its time set back, stops the run; a file:// URL of a local file is that file: checked, hashed and
read once as its path is."""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import quote

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
    """The read-on lines: its content as found (a file hashed whole), or its sampled parts as found."""
    return [r.getMessage() for r in caplog.records if r.getMessage().endswith("; reading on")]


def _count_hashes(monkeypatch) -> list[int]:
    """How often a file is hashed from now on (formats._content_digest)."""
    calls = [0]
    digest = getattr(formats.changes, "_content_digest", None)  # (absent before files were hashed)

    def counted(fd: int, size: int) -> bytes:
        calls[0] += 1
        assert digest is not None
        return digest(fd, size)

    monkeypatch.setattr(formats.changes, "_content_digest", counted, raising=False)
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
    monkeypatch.setattr(formats.changes, "DIGEST_WHOLE", 4096, raising=False)
    monkeypatch.setattr(formats.changes, "DIGEST_SAMPLE", 512, raising=False)
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


def test_a_large_file_edited_outside_its_samples_is_not_said_unchanged(tmp_path, caplog):
    """4 bytes written at offset 500,000 of a 1.1 MB text file (the same size, a new time) are outside the
    first, middle and last 64 KiB that its digest samples: it is read on, and the line said "its content is
    as the run found it", which was false. It names what was compared instead."""
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(f"document {i} words words\n\n".encode() for i in range(42_000)))
    size = path.stat().st_size
    assert size > formats.changes.DIGEST_WHOLE and size > 1_000_000
    sample = formats.changes.DIGEST_SAMPLE
    assert not (size - sample) // 2 <= 500_000 < (size + sample) // 2
    c = Corpus([str(path)])
    list(c.records())
    with open(path, "r+b") as f:
        f.seek(500_000)
        f.write(b"XXXX")
    _touch(path)
    assert path.stat().st_size == size
    with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
        list(c.records())  # read on: the digest cannot tell
    said = _said(caplog)
    assert len(said) == 1 and re.fullmatch(
        rf"corpus file {re.escape(str(path))}: modified at [^,]+, but its sampled parts \(first, middle and "
        r"last 64 KiB; the rest is not compared\) are as the run found them; reading on",
        said[0],
    ), said
    assert "content is as" not in said[0]


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


def _url(path, host: str = "") -> str:
    """A file:// URL of a local path, percent-encoded as a browser or `pathlib.Path.as_uri` writes it."""
    return f"file://{host}{quote(str(path))}"


def _change(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "appended":
        with open(path, "ab") as f:
            f.write(data[-100:])
    else:  # another file of the same size and time put in its place
        st = path.stat()
        other = path.with_name("other")
        other.write_bytes(_same_size_other_bytes(path))
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, path)


def _stopped(tmp_path, name: str, kind: str, how: str, given) -> tuple[str, str]:
    """(what the corpus was given as, the CorpusChanged line) for a corpus file changed in its second pass."""
    path = _corpus(tmp_path / name, kind)
    arg = given(path)
    c = Corpus([arg])
    list(c.records())
    records = c.records()
    next(records)
    _change(path, how)
    with pytest.raises(CorpusChanged) as err:
        list(records)
    return arg, str(err.value)


@pytest.mark.parametrize("how", ["truncated", "appended", "replaced"])
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow-file"])
@pytest.mark.parametrize(
    "given",
    [
        _url,
        lambda path: _url(path, "localhost"),
        lambda path: _url(path.parent) + "/*",  # a glob: each file it finds is checked as its path
    ],
    ids=["url", "localhost", "glob"],
)
def test_a_file_url_of_a_changed_file_stops_the_run_as_its_path_does(tmp_path, kind, how, given):
    """A file:// URL was read as a remote object: truncated, appended to or replaced during the run, it was
    read as it now was (or cut short by ranged reads), unchecked. It stops with its path's line, naming the
    URL as given."""
    path_arg, path_said = _stopped(tmp_path, "by-path", kind, how, str)
    url_arg, url_said = _stopped(tmp_path, "by-url", kind, how, given)
    url_file = (
        url_arg if not url_arg.endswith("*") else _url(tmp_path / "by-url" / os.path.basename(path_arg))
    )
    assert url_said == path_said.replace(path_arg, url_file)
    assert url_said.startswith(f"corpus file {url_file} changed during the run (")


def test_a_touched_file_url_is_read_on(tmp_path, caplog):
    """A file:// URL of a file touched (the same bytes, a new time) is read on, said once, as its path is."""
    path = _corpus(tmp_path)
    url = _url(path)
    c = Corpus([url])
    first = _texts(c.records())
    _touch(path)
    with caplog.at_level(logging.INFO, logger="lmpipe.producer"):
        assert _texts(c.records()) == first
        assert _texts(c.records()) == first
    said = _said(caplog)
    assert len(said) == 1 and re.fullmatch(
        rf"corpus file {re.escape(url)}: modified at .+, {READ_ON}", said[0]
    )


def test_a_corpus_of_file_urls_has_the_content_digest_of_its_paths(tmp_path):
    """The `data_content` a late producer must match: a corpus given as file:// URLs had none (""), so a
    producer given the paths could not be told from one given the same names of other content. A file, a
    folder, percent-encoded names and file://localhost all give the paths' digest and fingerprint."""
    d = tmp_path / "my corpus"
    a = write(d / "a b", builtin_docs(50), "jsonl")
    b = write(d / "sub dir" / "b", builtin_docs(50, seed=1), "parquet")
    paths = Corpus([str(d), str(b)])
    assert paths.content_digest()
    for given in ([_url(d), _url(b)], [_url(d, "localhost") + "/", _url(b, "localhost")], [_url(a), str(b)]):
        urls = Corpus(given)
        assert [f.path for f in urls.paths] == [str(f) for f in paths.paths], given
        assert urls.content_digest() == paths.content_digest(), given
        assert urls.fingerprint() == paths.fingerprint(), given


def test_percent_encoded_and_localhost_file_urls_are_their_files(tmp_path, caplog):
    """file:///.../a%20b.txt was looked up as a file named `a%20b.txt`, file://localhost/... as a folder
    `localhost` of the working directory: not found. Both are the file, read once beside its path, its
    records named by the URL as given."""
    path = tmp_path / "a b ü.txt"
    path.write_text("alpha one\n\nalpha two\n")
    for url in (_url(path), _url(path, "localhost"), f"local://{quote(str(path))}"):
        caplog.clear()
        c = Corpus([url, str(path)])
        assert [str(f) for f in c.paths] == [url] and c.paths[0].path == str(path)
        assert [(r.text, r.where) for r in c.records()] == [
            ("alpha one", f"{url}:1"),
            ("alpha two", f"{url}:3"),
        ]
        assert [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()] == [
            f"--data reaches 1 file(s) more than once; each is read once, where it first comes: {url} (again as "
            f"{path})"
        ]
