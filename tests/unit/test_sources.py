"""Corpus readers: document splitting, and bad input skipped with file:line, counted, never fatal."""

from __future__ import annotations

import json
import os

import msgpack
import pytest

from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from tests.helpers import WIKITEXT, write_bad_corpus


def test_bad_records_are_skipped_named_and_counted(tmp_path, tok):
    txt, jl = write_bad_corpus(tmp_path)
    bad = []
    stream = DocStream(
        Corpus([str(txt), str(jl)], max_line_bytes=1 << 20, vocab_size=tok.vocab_size),
        tok,
        shuffle_window=0,
        on_bad=lambda reason, where, detail: bad.append((reason, where)),
    )
    docs = list(stream.docs(0))
    texts = [tok.tokenizer.decode(d.ids[:-1].tolist()) for d in docs]
    assert texts[0] == "first document\nsecond line"
    assert texts[1] == "still the second document"
    assert "third document" in texts and "last document" in texts
    assert "a good json document" in texts and "the end" in texts
    assert [d.ids[:-1].tolist() for d in docs if d.ids.size == 4] == [[1, 2, 3]]
    assert sorted(bad) == sorted(
        [
            ("invalid_utf8", f"{txt}:4"),
            ("line_too_long", f"{txt}:7"),  # the block held only the over-long line: one report, not two
            ("invalid_utf8", f"{txt}:13"),
            ("bad_json", f"{jl}:2"),
            ("empty", f"{jl}:3"),
            ("missing_text", f"{jl}:4"),
            ("bad_ids", f"{jl}:6"),
            ("bad_json", f"{jl}:7"),
        ]
    )
    # a record id is a position in the corpus, bad records included, so ids are stable
    assert [d.doc_id for d in docs] == [0, 1, 3, 5, 6, 10, 13]


def test_a_lone_surrogate_escape_is_a_bad_record_not_a_crash(tmp_path, tok):
    """JSON can escape half a UTF-16 pair; the tokenizer refused the lone surrogate with a TypeError that
    stopped the producer with a traceback (a hostile sweep). A pair is one character, and trains."""
    jl = tmp_path / "s.jsonl"
    jl.write_text(
        '{"text": "abc \\ud800 def"}\n{"text": "a pair \\ud83d\\ude00 is fine"}\n'
        '{"prompt": "q \\uDFFF", "completion": "a"}\n{"text": "plain"}\n'
    )
    bad = []
    stream = DocStream(Corpus([str(jl)]), tok, shuffle_window=0, on_bad=lambda *r: bad.append(r[:2]))
    texts = [tok.tokenizer.decode(d.ids[:-1].tolist()) for d in stream.docs(0)]
    assert texts == ["a pair \U0001f600 is fine", "plain"]
    assert bad == [("invalid_utf8", f"{jl}:1"), ("invalid_utf8", f"{jl}:3")]


def test_each_bad_record_is_reported_by_exactly_one_worker(tmp_path, tok):
    txt, jl = write_bad_corpus(tmp_path)
    reports = []
    for w in range(3):
        s = DocStream(Corpus([str(txt), str(jl)]), tok, w, 3, on_bad=lambda *a: reports.append(a[:2]))
        list(s.docs(0))
        list(s.docs(1))  # a second epoch reports nothing again
    assert len(reports) == len(set(reports)) == 8  # the 8 of test_bad_records_are_skipped_named_and_counted


def test_a_producer_counts_each_bad_record_once_however_often_it_reads_a_shard(tmp_path, tok, caplog):
    """A real producer (no sockets: its control messages handed in) holds shard 0 of 2 of a JSONL corpus
    whose shard 0 has 1,200 bad lines among 1,200 good ones (shard 1's are another producer's: never
    counted here). The trainer asks for a resend after the first batch, mid-pass: the stream read its shard
    from the start again and counted the bad lines before the batch twice, in the count the trainer takes
    (each shard's highest) too. Then the shard is given up and taken back (a new stream, from the start):
    the producer's "N bad records skipped" added every read. Now: 1,200, the first ten logged line by line
    once, and the figure says whose it is."""
    import logging

    from lmpipe.producer.manager import Producer, ProducerOptions
    from lmpipe.shared import messages
    from lmpipe.shared.config import PipelineConfig

    words = " ".join(f"w{i}" for i in range(20))
    path = tmp_path / "c.jsonl"  # record i (line i + 1) is shard i % 2's; good when i % 4 == 0
    path.write_text("".join(f'{{"text": "{i} {words}"}}\n' if i % 4 == 0 else '{"text": "broken\n'
                            for i in range(4800)))  # fmt: skip
    cfg = PipelineConfig(data=[str(path)], runtime_dir=str(tmp_path / "run"), seq_len=64, batch_size=2,
                         shuffle_window=1, epochs=1)  # fmt: skip
    p = Producer(cfg, ProducerOptions())

    def tell(msg) -> None:
        p._control(messages.pack(msg))

    def read_to_the_end() -> None:
        while p.holdings.next_message("s") is not None:
            pass

    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"):
        tell(messages.Assign("s", [0], 2, 1))
        tell(messages.Welcome("s", 0, lease="L", shards=2))
        assert p.holdings.next_message("s") is not None  # the first batch: the first chunk read
        assert 0 < p._skipped[0]["bad_json"] < 1200, "mid-pass"
        tell(messages.Welcome("s", 0, lease="L", shards=2, force=True))  # a resend: the same stream
        read_to_the_end()
        assert p._skipped_counts() == {"0:bad_json": 1200}, "what the trainer is told"
        tell(messages.Assign("s", [], 2, 2))  # given up, then taken back: a new stream
        tell(messages.Assign("s", [0], 2, 1))
        tell(messages.Welcome("s", 0, lease="M", shards=2))
        read_to_the_end()
    assert p._skipped == {0: {"bad_json": 1200}}
    assert p._bad.total == 1200
    assert p._bad.summary() == "this producer skipped 1,200 bad records (1,200 bad_json)"
    logged = [r.getMessage() for r in caplog.records]
    lines = [f"{path}:{i + 1}:" for i in range(2, 4800, 4)][:10]  # the first ten, by line, once
    assert [m.split()[0] for m in logged[:10]] == lines, logged
    assert logged[10:] == [
        "more bad records are counted, not logged one by one",
        "this producer skipped 100 bad records (100 bad_json) so far",
        "this producer skipped 1,000 bad records (1,000 bad_json) so far",
    ]


def test_wikitext_heading_split_gives_articles():
    path = WIKITEXT / "valid.txt"
    if not path.exists():
        pytest.skip("WikiText-2 not present beside the checkout")
    articles = [r for r in Corpus([str(path)], doc_split="heading").records() if r.bad is None]
    paragraphs = [r for r in Corpus([str(path)]).records() if r.bad is None]
    assert 50 <= len(articles) <= 70  # WikiText-2 valid has 60 articles
    assert articles[1].text.startswith("= ") and len(paragraphs) > 10 * len(articles)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        Corpus([str(tmp_path / "nope.txt")])


def test_builtin_corpus_is_deterministic_and_varied():
    from lmpipe.producer import builtin_corpus

    assert builtin_corpus.document(0, 5) == builtin_corpus.document(0, 5)
    lengths = [len(builtin_corpus.document(0, i).split()) for i in range(500)]
    assert min(lengths) < 20 and max(lengths) > 500


def test_the_fingerprint_of_thousands_of_files_or_odd_names_fits_a_hello(tmp_path):
    """The corpus's fingerprint travels in every hello (16 KiB): 1,200 files named like C4's shards took
    36 KB and got the producers refused; a file name that is not UTF-8 could not be sent at all."""
    for i in range(1200):
        (tmp_path / f"c4-train.{i:05d}-of-01200.json.txt").write_text(f"document {i}\n")
    odd = os.fsdecode(b"bad\xff.txt")
    (tmp_path / odd).write_text("odd name\n")
    fp = Corpus([str(tmp_path)]).fingerprint()
    assert fp.startswith("blank|1201 files of ") and len(fp) < 100
    first = str(tmp_path / "c4-train.00000-of-01200.json.txt")  # read first, then the folder's others
    assert fp != Corpus([first, str(tmp_path)]).fingerprint(), "the list of files decides it"
    assert Corpus([str(tmp_path / odd)]).fingerprint() == "blank|bad\\xff.txt:9"
    msgpack.packb(fp)  # what failed: a surrogate in the name


def test_the_content_digest_tells_files_of_the_same_names_and_sizes_apart(tmp_path):
    """`data` (the fingerprint) holds names and sizes only; the hello's `data_content` digests the contents
    too, the same on any host (base names, not paths), so that the trainer can refuse a later producer
    whose files were rewritten or are another host's."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    body = bytearray(b"".join(b"document %d of the corpus\n\n" % i for i in range(6000)))
    assert 64 * 1024 < len(body) < 256 * 1024  # hashed whole: any byte counts
    for d in (a, b, c):
        d.mkdir()
        (d / "one.txt").write_text("the first file\n")
    (a / "two.txt").write_bytes(body)
    (b / "two.txt").write_bytes(body)  # the same bytes under another directory
    body[len(body) // 3] ^= 1  # one byte changed: same name, same size
    (c / "two.txt").write_bytes(body)
    ca, cb, cc = (Corpus([str(d)]) for d in (a, b, c))
    assert ca.fingerprint() == cb.fingerprint() == cc.fingerprint(), "names and sizes alike"
    assert len(ca.content_digest()) == 32 and ca.content_digest() == Corpus([str(a)]).content_digest()
    assert ca.content_digest() == cb.content_digest(), "the same content in another place: the same digest"
    assert ca.content_digest() != cc.content_digest(), "one byte changed"
    one, two = str(a / "one.txt"), str(a / "two.txt")
    assert Corpus([one, two]).content_digest() != Corpus([two, one]).content_digest(), "in corpus order"
    assert Corpus([]).content_digest() == "", "the built-in corpus: `data` says it all"


def test_a_file_reached_twice_is_read_once_and_said_once(tmp_path, caplog):
    """`--data dir dir/a.txt`, a file named twice (or as ./a.txt), a symlink or hard link to a file the run
    reads: every document of that file was trained twice an epoch, unsaid."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("alpha one\n\nalpha two\n")
    (d / "b.txt").write_text("beta\n")
    read = Corpus([str(d)]).fingerprint()
    assert read == "blank|a.txt:21|b.txt:5", "a corpus without duplicates keeps its fingerprint (checkpoints)"
    (d / "z.txt").symlink_to("a.txt")
    os.link(d / "b.txt", tmp_path / "hard.txt")
    given = [str(d), str(d / "a.txt"), f"{tmp_path}/./d/b.txt", str(tmp_path / "hard.txt"), str(d / "a.txt")]
    for _ in range(2):  # the second time (a producer, after the checks) says nothing again
        c = Corpus(given)
        assert [str(p) for p in c.paths] == [str(d / "a.txt"), str(d / "b.txt")]
        assert [r.text for r in c.records()] == ["alpha one", "alpha two", "beta"]
        assert c.fingerprint() == read  # the files read, as a run without the duplicates
    said = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
    assert said == [
        f"--data reaches 2 file(s) more than once; each is read once, where it first comes: {d}/a.txt (again "
        f"as {d}/z.txt, {d}/a.txt, {d}/a.txt); {d}/b.txt (again as {d}/b.txt, {tmp_path}/hard.txt)"
    ]


def _change(path, how: str) -> None:
    """Change corpus file `path` as someone might while a run reads it."""
    st = path.stat()
    if how == "emptied":
        path.write_bytes(b"")
    elif how == "appended":
        with open(path, "ab") as f:
            f.write(b"\n\none more document\n")
    elif how == "rewritten":  # same size, other bytes; the clock of a coarse file system cannot hide it
        path.write_bytes(bytes(reversed(path.read_bytes())))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    elif how == "deleted":
        path.unlink()
    elif how == "a directory":
        path.unlink()
        path.mkdir()


CHANGES = {
    "emptied": r"\(([\d,]+) -> 0 bytes\)",
    "appended": r"\(([\d,]+) -> ([\d,]+) bytes\)",
    "rewritten": r"\(still [\d,]+ bytes, but modified at ",
    "deleted": r"\(deleted or moved away\)",
    "a directory": r"\(now a directory\)",
}


def _corpus_file(tmp_path, kind: str):
    docs = [f"document {i} " + "words " * (i % 7) for i in range(3000)]
    text = "\n\n".join(docs).encode() + b"\n"
    path = tmp_path / f"c.{kind}"
    if kind == "txt":
        path.write_bytes(text)
    elif kind == "jsonl.gz":
        import gzip

        path.write_bytes(gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs)))
    elif kind == "txt.zst":
        zstandard = pytest.importorskip("zstandard")
        path.write_bytes(zstandard.ZstdCompressor().compress(text))
    else:
        pa = pytest.importorskip("pyarrow")
        table = pa.table({"text": docs})
        if kind == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path, row_group_size=500)
        else:
            with pa.ipc.new_file(path, table.schema) as w:
                for batch in table.to_batches(max_chunksize=500):
                    w.write_batch(batch)
    return path, len(docs)


KINDS = ["txt", "jsonl.gz", "txt.zst", "parquet", "arrow"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", list(CHANGES))
def test_a_file_changed_between_passes_stops_the_next_one(tmp_path, kind, how):
    """A corpus file truncated, grown or rewritten between epochs was read as it now is: an emptied one
    made an empty epoch, which ended an --epochs 0 run at exit 0 as if it were complete."""
    path, n = _corpus_file(tmp_path, kind)
    c = Corpus([str(path)])
    assert sum(r.bad is None for r in c.records()) == n  # the first pass
    _change(path, how)
    with pytest.raises(ValueError, match=rf"^corpus file {path} changed during the run {CHANGES[how]}"):
        list(c.records())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["emptied", "appended", "rewritten"])
def test_a_file_changed_during_a_pass_stops_it(tmp_path, kind, how):
    """Changed under a reader: the pass may have read some of it as it is now, so it cannot end as if
    it had read the file the run started with (nor call a cut-short .gz corrupt)."""
    path, n = _corpus_file(tmp_path, kind)
    records = Corpus([str(path)]).records()
    next(records)
    _change(path, how)
    with pytest.raises(ValueError, match=rf"^corpus file {path} changed during the run {CHANGES[how]}"):
        list(records)
