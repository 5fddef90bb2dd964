"""Corpus files a hostile sweep found mishandled: a UTF-8 BOM read as content, an unreadable file in a --data
folder found only by the producers, a FIFO left out unsaid, a truncated .gz's progress under-reported, the
bad-record and lone-share wordings, and CR-only line endings left without a hint."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import shutil
import zlib

import pytest
import zstandard

from lmpipe.producer import formats
from lmpipe.producer.formats import FormatError
from lmpipe.producer.sources import BadRecords, Corpus
from lmpipe.producer.stream import DocStream

BOM = b"\xef\xbb\xbf"


def records(path, **kw) -> list[tuple[int, str | None, str | None, str]]:
    return [(r.rid, r.text, r.bad and r.bad[0], r.where) for r in Corpus([str(path)], **kw).records()]


def compress(data: bytes, suffix: str) -> bytes:
    if suffix == ".gz":
        return gzip.compress(data)
    if suffix == ".zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_a_leading_bom_is_not_content(tmp_path, fmt, suffix):
    if fmt == "jsonl":
        body = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(6)).encode()
    else:
        body = "".join(f"document {i}\nits second line\n\n" for i in range(6)).encode()
    plain = tmp_path / "plain" / f"c.{fmt}{suffix}"
    bom = tmp_path / "bom" / f"c.{fmt}{suffix}"
    for p, data in ((plain, body), (bom, BOM + body)):
        p.parent.mkdir()
        p.write_bytes(compress(data, suffix))
    want = [(rid, text, bad, where.replace("/plain/", "/bom/")) for rid, text, bad, where in records(plain)]
    got = records(bom)
    assert got == want, "the same records, ids and line numbers as without the BOM"
    assert got[0][2] is None and got[0][1] in ("record 0", "document 0\nits second line")


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_a_bom_file_resumed_past_its_first_record_gives_the_same_documents(tmp_path, tok, suffix):
    """A resumed reader (a cursor's position) reads the file from its start and skips to the position: past
    the first record it gets what reading from the start got there, for each shard."""
    body = "".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(40)).encode()
    path = tmp_path / f"c.jsonl{suffix}"
    path.write_bytes(compress(BOM + body, suffix))
    for w in range(2):

        def docs(start: int, w: int = w) -> list[tuple[int, list[int]]]:
            s = DocStream(Corpus([str(path)]), tok, w, 2, shuffle_window=8, seed=3)
            return [(d.doc_id, d.ids.tolist()) for d in s.docs(0, start)]

        whole = docs(0)
        assert sorted(rid for rid, _ in whole) == list(range(w, 40, 2)), "record 0 is not dropped"
        for start in (1, 5):
            assert docs(start) == whole[start:]


def test_only_a_bom_at_byte_0_is_dropped_and_the_line_limit_counts_content(tmp_path):
    later = tmp_path / "later.txt"
    later.write_bytes(b"first\n\n" + BOM + b"second\n")
    assert [r[1] for r in records(later)] == ["first", "\ufeffsecond"], "a BOM inside the file is text"
    only = tmp_path / "only.txt"
    only.write_bytes(BOM)
    with pytest.raises(StopIteration):
        next(Corpus([str(only)]).records())
    edge = tmp_path / "edge.txt"  # a first line of exactly --max-line-bytes after its BOM: not too long
    edge.write_bytes(BOM + b"x" * 64 + b"\nnext\n")
    assert [r[1:3] for r in records(edge, max_line_bytes=64, doc_split="line")] == [
        ("x" * 64, None),
        ("next", None),
    ]


def test_an_unreadable_file_fails_when_the_corpus_is_resolved(tmp_path, monkeypatch):
    d = tmp_path / "permdir"
    d.mkdir()
    (d / "a.txt").write_text("readable\n")
    (d / "b.txt").write_text("not readable\n")
    real_open = os.open

    def deny(path, flags, *args, **kw):
        if os.fspath(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(formats.changes.os, "open", deny)
    for given in (str(d), str(d / "b.txt"), f"file://{d}/b.txt"):
        with pytest.raises(PermissionError) as e:
            formats.resolve([given])
        shown = given if given.startswith("file:") else f"{d}/b.txt"
        assert str(e.value) == f"corpus file {shown}: cannot read it (Permission denied)"


def test_a_fifo_in_a_data_folder_is_named_as_left_out(tmp_path):
    d = tmp_path / "mix"
    d.mkdir()
    (d / "a.txt").write_text("a document\n")
    os.mkfifo(d / "fifo.txt")
    assert formats.left_out([str(d)]) == [f"{d}/fifo.txt (not a regular file)"]
    assert [f.path for f in formats.resolve([str(d)])] == [str(d / "a.txt")]


@pytest.mark.parametrize("size", [5_000, 3 << 20])
def test_a_truncated_gzip_says_how_far_it_read_without_overstating(tmp_path, size):
    """GzipFile drops what it decompressed in the read that fails, so the count is a floor: never more than
    what decompresses (the old message said "after N" as if the damage were at N)."""
    data = b"".join(json.dumps({"text": f"document {i} " * 5}).encode() + b"\n" for i in range(size // 60))
    cut = gzip.compress(data)[: -max(8, len(gzip.compress(data)) // 10)]
    d = zlib.decompressobj(31)
    decompressed = len(d.decompress(cut))
    assert decompressed > 0 and not d.eof
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(cut)
    with pytest.raises(
        FormatError, match=r"truncated or corrupt past its first ([\d,]+) decompressed bytes"
    ) as e:
        records(path)
    said = int(re.search(r"past its first ([\d,]+)", str(e.value)).group(1).replace(",", ""))
    assert said <= decompressed


def test_gzip_members_and_zero_padding_are_read_as_gzip_reads_them(tmp_path):
    a = b"".join(f'{{"text": "a {i}"}}\n'.encode() for i in range(3000))
    b = b"".join(f'{{"text": "b {i}"}}\n'.encode() for i in range(3000))
    path = tmp_path / "m.jsonl.gz"
    path.write_bytes(gzip.compress(a) + gzip.compress(b) + b"\0" * 100)
    assert [r[1] for r in records(path)] == [f"a {i}" for i in range(3000)] + [f"b {i}" for i in range(3000)]
    junk = tmp_path / "junk.jsonl.gz"
    junk.write_bytes(gzip.compress(a) + b"not gzip")
    with pytest.raises(FormatError, match=r"decompressed bytes \(Not a gzipped file"):
        records(junk)
    crc = bytearray(gzip.compress(a))
    crc[-8] ^= 1  # the member's CRC
    (tmp_path / "crc.jsonl.gz").write_bytes(bytes(crc))
    with pytest.raises(FormatError, match="truncated or corrupt"):
        records(tmp_path / "crc.jsonl.gz")


def test_a_bad_line_says_skipped_once_and_counts_agree_in_number(tmp_path, caplog):
    path = tmp_path / "b.txt"
    path.write_bytes(b"good line\nbad \xff line\nmore\n")
    bad = BadRecords(logging.getLogger("lmpipe.producer"), "this producer")
    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"):
        for rec in Corpus([str(path)]).records():
            for reason, where, detail in rec.warnings or []:
                bad(reason, where, detail)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        f"{path}:2: invalid UTF-8 at byte 4 (is the file UTF-8? Latin-1 or Windows-1252 text converts with "
        "iconv -f cp1252 -t utf-8) (invalid_utf8), skipped"
    )
    assert bad.summary() == "this producer skipped 1 bad record (1 invalid_utf8)"
    two = BadRecords(logging.getLogger("x"))
    two("empty", "f:1", "empty"), two("empty", "f:2", "empty")
    assert two.summary() == "2 bad records skipped (2 empty)"


def lone_share_lines(tmp_path, tok, caplog, path, shards: int, **kw) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"):
        for w in range(shards):
            list(DocStream(Corpus([str(path)], **kw), tok, w, shards).docs(0))
    return [r.getMessage() for r in caplog.records if "owns a single" in r.getMessage()]


def test_the_blank_line_hint_is_given_only_for_a_file_without_blank_lines(tmp_path, tok, caplog):
    two = tmp_path / "two.txt"
    two.write_text("first document\nits second line\n\nsecond document\nits second line\n")
    (line,) = lone_share_lines(tmp_path, tok, caplog, two, 2)
    assert line.startswith("shard 0 of 2 owns a single document")
    assert "blank lines" not in line and "--doc-split" not in line, "it has blank lines and two documents"
    caplog.clear()
    one = tmp_path / "one.txt"
    one.write_text("first sentence\nsecond sentence\nthird sentence\n")
    (line,) = lone_share_lines(tmp_path, tok, caplog, one, 2)
    assert f"{one} has no blank lines: each is one document: for one per line, use --doc-split line" in line
    caplog.clear()  # --doc-split heading on a file without WikiText's ' = Heading = ' lines: no hint before
    plain = tmp_path / "plain.txt"
    plain.write_text("first sentence\n\nsecond sentence\n")
    (line,) = lone_share_lines(tmp_path, tok, caplog, plain, 2, doc_split="heading")
    assert f"{plain} has no ' = Heading = ' lines: each is one document: --doc-split blank" in line


CR_SAID = "the file has CR line endings (\\r without \\n, old Mac style) and lines are split on \\n only"


def test_cr_line_endings_are_said_not_hinted_at_with_the_split_already_set(tmp_path, tok, caplog):
    path = tmp_path / "cr.txt"
    path.write_bytes(b"".join(b"line %d of an old Mac file\r" % i for i in range(50)))
    lines = lone_share_lines(tmp_path, tok, caplog, path, 2, doc_split="line")
    said = [r.getMessage() for r in caplog.records]
    assert f"{path}: {CR_SAID}: convert it, e.g. tr '\\r' '\\n' < IN > OUT" in said
    assert lines[0].startswith("shard 0 of 2 owns a single document") and CR_SAID in lines[0]
    assert "use --doc-split line" not in "\n".join(said)
    caplog.clear()
    blank = tmp_path / "cr2.txt"  # (a lone share is said once per corpus and process)
    shutil.copy(path, blank)
    assert CR_SAID in lone_share_lines(tmp_path, tok, caplog, blank, 2)[0], "under --doc-split blank too"


def test_an_over_long_cr_file_says_why_its_line_is_too_long(tmp_path):
    path = tmp_path / "cr_big.txt"
    path.write_bytes(b"".join(b"line %d of an old Mac file\r" % i for i in range(5000)))
    (rec,) = Corpus([str(path)], max_line_bytes=1 << 16).records()
    assert rec.bad is not None and rec.bad[0] == "line_too_long"
    assert rec.bad[1].startswith("line of ") and CR_SAID in rec.bad[1]
    crlf = tmp_path / "crlf.txt"  # Windows line endings are lines, and no CR notice
    crlf.write_bytes(b"a\r\nb\r\n\r\nc\r\n")
    corpus = Corpus([str(crlf)])
    assert [r.text for r in corpus.records()] == ["a\nb", "c"] and not corpus.cr_endings


def test_text_column_names_the_json_lines_key(tmp_path, caplog):
    """A JSONL corpus keeping its documents under another key ("content") was all missing_text, and
    --text-column said it was for tables only; it now names the key, and the rejection names the keys there."""
    path = tmp_path / "c.jsonl"
    lines = [{"content": f"document {i}", "url": f"https://x/{i}"} for i in range(5)] + [{"text": "other"}]
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    read = records(path, text_column="content")
    assert [t for _, t, _, _ in read[:5]] == [f"document {i}" for i in range(5)]
    assert read[5][2] == "missing_text", "the other key is not read once a key is named"
    bad = list(Corpus([str(path)]).records())
    assert [r.bad and r.bad[0] for r in bad] == ["missing_text"] * 5 + [None]
    assert "its string keys: content, url (--text-column NAME reads one)" in bad[0].bad[1]
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"content": "kept", "text": "not read"}) + "\n")
    with caplog.at_level(logging.WARNING):
        assert [r.text for r in Corpus([str(both)], text_column="content").records()] == ["kept"]
    assert '"text" not read: a record with "content" trains its text' in caplog.text


@pytest.mark.parametrize(
    "kind, name, said",
    [
        ("gzip", "c.txt", "gzip data under a text file's name (a file's format comes from its name); add .gz to its name "
                             "(x.txt.gz, x.jsonl.gz)"),
        ("zstd", "c.jsonl", "zstd data under a JSONL file's name (a file's format comes from its name); add .zst to its "
                                "name (x.txt.zst, x.jsonl.zst)"),
        ("parquet", "c.txt", "Parquet data under a text file's name (a file's format comes from its name); "
                             "name it .parquet"),
        ("arrow", "c.txt", "Arrow data under a text file's name (a file's format comes from its name); name it "
                           ".arrow"),
    ],
)  # fmt: skip
def test_a_misnamed_compressed_file_or_table_is_named_for_what_it_is(tmp_path, kind, name, said):
    """A .gz renamed .txt was refused as "binary data (a NUL byte at offset 3)", or read as thousands of
    invalid-UTF-8 records when its header had no NUL; a Parquet or Arrow file the same."""
    import pyarrow as pa
    import pyarrow.feather
    import pyarrow.parquet as pq

    path = tmp_path / name
    body = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(50)).encode()
    if kind in ("gzip", "zstd"):
        path.write_bytes(compress(body, {"gzip": ".gz", "zstd": ".zst"}[kind]))
    elif kind == "parquet":
        pq.write_table(pa.table({"text": ["a", "b"]}), path)
    else:
        pyarrow.feather.write_feather(pa.table({"text": ["a", "b"]}), path, compression="uncompressed")
    with pytest.raises(ValueError) as err:
        Corpus([str(path)])
    assert str(err.value) == f"{path}: {said}"


def test_text_that_starts_like_a_table_magic_is_still_text(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("PAR1 is the name of a part\n\nARROW1 another\n")
    assert [t for _, t, _, _ in records(path)] == ["PAR1 is the name of a part", "ARROW1 another"]


def test_each_skipped_line_is_its_own_bad_record_under_doc_split_line(tmp_path):
    """Every line is a document under --doc-split line, so an invalid-UTF-8 or too-long line is a bad
    record with its own id; it was attached to the line before it as a warning, and took no id."""
    path = tmp_path / "c.txt"
    path.write_bytes(b"line one\nbad \xff line\n\xfe\nline four\n" + b"x" * 200 + b"\n\nline seven\n\xff")
    got = records(path, doc_split="line", max_line_bytes=100)
    assert [(rid, text or None, bad, where.rsplit(":", 1)[1]) for rid, text, bad, where in got] == [
        (0, "line one", None, "1"),
        (1, None, "invalid_utf8", "2"),
        (2, None, "invalid_utf8", "3"),
        (3, "line four", None, "4"),
        (4, None, "line_too_long", "5"),
        (5, "line seven", None, "7"),
        (6, None, "invalid_utf8", "8"),
    ]
    assert not any(r.warnings for r in Corpus([str(path)], doc_split="line", max_line_bytes=100).records())


def test_a_nul_byte_past_the_probed_head_is_a_bad_binary_line(tmp_path):
    """The binary probe reads a file's first 8 KB; a NUL further on (an appended blob, UTF-16 text) was
    tokenized as text. Now the line is skipped and counted as binary, the text around it kept."""
    path = tmp_path / "c.txt"
    head = b"".join(b"clean line %d\n" % i for i in range(1000))  # past BINARY_PROBE_BYTES
    path.write_bytes(head + "utf-16 text".encode("utf-16-le") + b"\nok\x00not\nlast line\n")
    got = records(path, doc_split="line")
    assert [(text or None, bad, where.rsplit(":", 1)[1]) for _, text, bad, where in got[-3:]] == [
        (None, "binary", "1001"),
        (None, "binary", "1002"),
        ("last line", None, "1003"),
    ]
    assert len(got) == 1003 and all(bad is None for _, _, bad, _ in got[:1000])
    kept = list(
        Corpus([str(path)]).records()
    )  # blank-line documents: the bad line is a warning on its document
    assert all("\0" not in (r.text or "") for r in kept)
    assert [w[0] for r in kept for w in (r.warnings or [])] == ["binary", "binary"]


def test_a_local_glob_the_shell_left_is_expanded_in_order(tmp_path):
    """--data 'corpus/*.txt' (quoted, or from LMPIPE_DATA) was "corpus file not found"; object-store and
    file:// globs were already expanded."""
    for name in ("b.txt", "a.txt", "c.jsonl", ".hidden.txt", "sub/z.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n" if name.endswith("l") else f"{name}\n")
    names = [f.path[len(str(tmp_path)) + 1 :] for f in formats.resolve([f"{tmp_path}/*.txt"])]
    assert names == ["a.txt", "b.txt"], "sorted, hidden files left out, as the shell expands it"
    assert [f.path[len(str(tmp_path)) + 1 :] for f in formats.resolve([f"{tmp_path}/**/*.txt"])] == [
        "a.txt", "b.txt", "sub/z.txt"]  # fmt: skip
    assert [r.text for r in Corpus([f"{tmp_path}/[ab].txt", f"{tmp_path}/*.jsonl"]).records()] == [
        "a.txt", "b.txt", "c.jsonl"]  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"^corpus path .*/\*\.parquet matches no file$"):
        formats.resolve([f"{tmp_path}/*.parquet"])
