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


def test_each_bad_record_is_reported_by_exactly_one_worker(tmp_path, tok):
    txt, jl = write_bad_corpus(tmp_path)
    reports = []
    for w in range(3):
        s = DocStream(Corpus([str(txt), str(jl)]), tok, w, 3, on_bad=lambda *a: reports.append(a[:2]))
        list(s.docs(0))
        list(s.docs(1))  # a second epoch reports nothing again
    assert len(reports) == len(set(reports)) == 8  # the 8 of test_bad_records_are_skipped_named_and_counted


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


@pytest.mark.slow
def test_a_json_line_nested_too_deeply_is_a_bad_record_not_a_crash(procs, tmp_path, port):
    """{"a":{"a":... 50,000 deep (300 KB, under --max-line-bytes) overflowed json's recursion: the producer
    died with a traceback and took the run with it."""
    data = tmp_path / "deep.jsonl"
    deep = '{"a":' * 50_000 + "1" + "}" * 50_000
    good = [json.dumps({"text": f"document {i} " + "words " * 20}) for i in range(40)]
    data.write_text("\n".join(good[:20] + [deep, "[" * 50_000] + good[20:]) + "\n")
    summary = tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", str(data), "--epochs", "1", "--steps", "0", "--seq-len", "32", "--batch-size", "2",
        "--producers", "2", "--port", str(port), "--metrics-port", "-1", "--summary-json", str(summary),
        "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    text = procs.log(p)
    assert "Traceback" not in text
    assert f"{data}:21: JSON nested too deeply to parse" in text and f"{data}:22: JSON nested" in text
    assert json.loads(summary.read_text())["stopped_by"] == "end of data"


def test_the_fingerprint_of_thousands_of_files_or_odd_names_fits_a_hello(tmp_path):
    """The corpus's fingerprint travels in every hello (16 KiB): 1,200 files named like C4's shards took
    36 KB and got the producers refused; a file name that is not UTF-8 could not be sent at all."""
    for i in range(1200):
        (tmp_path / f"c4-train.{i:05d}-of-01200.json.txt").write_text(f"document {i}\n")
    odd = os.fsdecode(b"bad\xff.txt")
    (tmp_path / odd).write_text("odd name\n")
    fp = Corpus([str(tmp_path)]).fingerprint()
    assert fp.startswith("blank|1201 files of ") and len(fp) < 100
    assert fp != Corpus([str(tmp_path / odd), str(tmp_path)]).fingerprint(), "the list of files decides it"
    assert Corpus([str(tmp_path / odd)]).fingerprint() == "blank|bad\\xff.txt:9"
    msgpack.packb(fp)  # what failed: a surrogate in the name
