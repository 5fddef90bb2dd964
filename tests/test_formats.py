"""Parquet, Arrow, Hugging Face save_to_disk folders and gzip/zstd JSONL: the same records as plain JSONL,
bad rows named by file and row, broken files stopped with one line, every format through `lmpipe prepare`
and through a real run (every document's tokens trained exactly once)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lmpipe.producer.formats import FormatError
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from tests.corpora import FORMATS, builtin_docs, token_lengths, write, write_hf_dataset
from tests.helpers import REPO, assert_exactly_once, read_doc_log

BAD = {5: None, 7: "   ", 200: None}  # None: a bad record of the format (null row, broken JSON line)


def corpus_docs(n: int = 300) -> list[str | None]:
    docs = builtin_docs(n)
    for i, d in BAD.items():
        docs[i] = d
    return docs


def read(path, worker=0, num_workers=1, **kw) -> list[tuple[int, str | None, str | None, str]]:
    return [
        (r.rid, r.text, r.bad and r.bad[0], r.where)
        for r in Corpus([str(path)], **kw).records(worker, num_workers)
    ]


def test_every_format_gives_the_records_of_plain_jsonl(tmp_path):
    docs = corpus_docs()
    ref = {w: read(write(tmp_path / "ref", docs, "jsonl"), w, 3) for w in range(3)}
    for fmt in FORMATS:
        path = write(tmp_path / fmt.replace(".", "-") / "c", docs, fmt, rows_per_group=32)
        for w in range(3):
            got = read(path, w, 3)
            assert [r[0] for r in got] == [r[0] for r in ref[w]], f"{fmt}: record ids of worker {w}"
            assert [r[1] for r in got if not r[2]] == [r[1] for r in ref[w] if not r[2]], fmt
            assert (
                {r[0] for r in got if r[2]}
                == {r[0] for r in ref[w] if r[2]}
                == set(BAD) & {i for i in range(300) if i % 3 == w}
            )
        rows = {r[0]: r for r in read(path)}
        if fmt.startswith("jsonl"):
            assert rows[5][2:] == ("bad_json", f"{path}:6") and rows[7][2:] == ("empty", f"{path}:8")
        elif fmt == "hf":  # 300 rows in two Arrow files of 150: row 200 is the second file's row 50
            assert rows[200][2:] == ("missing_text", f"{path}/data-00001-of-00002.arrow:row 50")
        else:
            assert rows[5][2:] == ("missing_text", f"{path}:row 5") and rows[7][2:] == (
                "empty",
                f"{path}:row 7",
            )


def test_formats_are_detected_by_content_when_the_name_does_not_say(tmp_path):
    docs = builtin_docs(40)
    ref = read(write(tmp_path / "ref", docs, "jsonl"))
    for fmt, name in (("parquet", "part-00000"), ("arrow", "cache-1f2e3d"), ("arrow-file", "table.bin")):
        src = write(tmp_path / fmt, docs, fmt)
        shutil.copy(src, tmp_path / name)
        got = read(tmp_path / name)
        assert [(r[0], r[1]) for r in got] == [(r[0], r[1]) for r in ref], fmt
    flat = [" ".join(d.split()) for d in docs]  # one paragraph each: blank lines split text documents
    text = "\n\n".join(flat) + "\n"
    (tmp_path / "notes").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "notes.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    plain = tmp_path / "plain.txt"
    plain.write_text("PAR1 is how this text begins, not a Parquet file\n")
    assert [r[1] for r in read(tmp_path / "notes")] == [r[1] for r in read(tmp_path / "notes.zst")] == flat
    assert [r[1] for r in read(plain)] == ["PAR1 is how this text begins, not a Parquet file"]
    # a directory stands for its corpus files; dataset_info.json-like configs beside them are not records
    folder = tmp_path / "mixed"
    write(folder / "a", docs[:20], "parquet")
    write(folder / "b", docs[20:30], "jsonl.gz").rename(folder / "b.json.gz")  # as C4 names its files
    write(folder / "c", docs[30:], "jsonl.zst")
    (folder / "config.json").write_text("{}")
    assert [r[1] for r in read(folder)] == docs


def test_bad_rows_are_named_counted_and_skipped(tmp_path, tok):
    texts = pa.array([b"good one", None, b"   ", b"bad \xff\xfe utf8", b"good two"], pa.binary())
    pq.write_table(pa.table({"text": texts.view(pa.string())}), tmp_path / "t.parquet", row_group_size=2)
    ids = [
        [1, 2, 3],
        None,
        [],
        [4, tok.vocab_size],
        [5, 6],
        [7, None, 8],
    ]  # a null inside a list: a traceback
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32()))}), tmp_path / "i.parquet")
    pq.write_table(
        pa.table({"ids": pa.array([[1, 2**63 + 5]], pa.list_(pa.uint64()))}), tmp_path / "u.parquet"
    )
    bad = []
    files = [str(tmp_path / name) for name in ("t.parquet", "i.parquet", "u.parquet")]
    corpus = Corpus(files, vocab_size=tok.vocab_size)
    stream = DocStream(
        corpus, tok, shuffle_window=0, on_bad=lambda reason, where, _: bad.append((reason, where))
    )
    docs = list(stream.docs(0))
    assert [d.doc_id for d in docs] == [0, 4, 5, 9]
    assert tok.tokenizer.decode(docs[1].ids[:-1].tolist()) == "good two"
    assert [d.ids[:-1].tolist() for d in docs[2:]] == [[1, 2, 3], [5, 6]]
    t, i = tmp_path / "t.parquet", tmp_path / "i.parquet"
    assert bad == [
        ("missing_text", f"{t}:row 1"),
        ("empty", f"{t}:row 2"),
        ("invalid_utf8", f"{t}:row 3"),
        ("missing_text", f"{i}:row 1"),
        ("empty", f"{i}:row 2"),
        ("bad_ids", f"{i}:row 3"),
        ("bad_ids", f"{i}:row 5"),
        ("bad_ids", f"{tmp_path / 'u.parquet'}:row 0"),
    ]


def test_a_named_text_column_is_read_and_a_missing_one_is_named(tmp_path):
    path = write(tmp_path / "c", ["alpha", "beta"], "parquet", column="content")
    assert [r[1] for r in read(path, text_column="content")] == ["alpha", "beta"]
    assert Corpus([str(path)], text_column="content").fingerprint() != Corpus([str(path)]).fingerprint()
    with pytest.raises(
        FormatError, match=r"c\.parquet: no column 'text' \(columns: content\).*--text-column"
    ):
        read(path)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(FormatError, match=r"n\.parquet: column 'text' is int64, not text"):
        read(tmp_path / "n.parquet")


def test_a_category_column_reads_as_its_values(tmp_path):
    """pandas writes a category column as an Arrow dictionary: it was refused as "not text"."""
    import pyarrow.feather

    docs = ["one doc", "two doc", "one doc", None, "é"]
    table = pa.table({"text": pa.array(docs).dictionary_encode()})
    pq.write_table(table, tmp_path / "c.parquet")
    pyarrow.feather.write_feather(table, tmp_path / "c.arrow", compression="uncompressed")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "c.parquet").field("text").type)
    for name in ("c.parquet", "c.arrow"):
        got = read(tmp_path / name)
        assert [t for _, t, _, _ in got] == docs and got[3][2] == "missing_text"
        assert [r[1] for r in read(tmp_path / name, 1, 2)] == ["two doc", None]  # a worker's share


def test_broken_files_stop_with_one_line_naming_them(tmp_path):
    data = ("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(2000)) + "\n").encode()
    cases = {
        "cut.jsonl.gz": gzip.compress(data)[:3000],
        "cut.jsonl.zst": zstandard.ZstdCompressor().compress(data)[:3000],
        "junk.jsonl.zst": b"\x28\xb5\x2f\xfd" + b"not zstd at all" * 100,
    }
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(
            FormatError, match=rf"{name}: \w+ data is truncated or corrupt past its first [\d,]+ decompressed"
        ):
            read(tmp_path / name)
    good = write(tmp_path / "p", builtin_docs(200), "parquet", rows_per_group=20)
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(FormatError, match=r"cut\.parquet: unreadable Parquet data after row 0"):
        read(tmp_path / "cut.parquet")
    hf = tmp_path / "dd"
    write_hf_dataset(hf / "train", ["a", "b"])
    (hf / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(
        FormatError, match=r"DatasetDict \(splits: train, test\); pass one split's folder, e\.g\. .*dd/train"
    ):
        Corpus([str(hf)])
    (hf / "train" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(FormatError, match=r"state\.json lists data-00001-of-00002\.arrow, which is missing"):
        Corpus([str(hf / "train")])


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    parquet = write(tmp_path / "c", ["x"], "parquet")
    zst = write(tmp_path / "c", ["x"], "jsonl.zst")
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['zstandard'] = None\n"
        "from lmpipe.cli import main\n"
        f"print('rc', main(['prepare', '--data', {str(parquet)!r}, '--out', {str(tmp_path / 'o')!r}]),"
        f" main(['prepare', '--data', {str(zst)!r}, '--out', {str(tmp_path / 'o')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "rc 2 2" in out.stdout, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in out.stderr
    assert f"{parquet}: reading Parquet needs pyarrow: pip install 'lmpipe[parquet]'" in lines[0]
    assert f"{zst}: reading zstd needs zstandard: pip install 'lmpipe[zstd]'" in lines[1]


def test_prepare_accepts_every_format(tmp_path):
    from lmpipe.cli import main

    docs = corpus_docs(240)
    shards = {}
    for fmt in FORMATS:  # plain JSONL first: the reference
        path = write(tmp_path / "src" / fmt.replace(".", "-"), docs, fmt)
        out = tmp_path / "shards" / fmt
        assert main(["prepare", "--data", str(path), "--out", str(out)]) == 0
        meta = json.loads((out / "meta.json").read_text())
        shards[fmt] = (meta["documents"], meta["tokens"], (out / "tokens-00000.bin").read_bytes(),
                       (out / "rids-00000.bin").read_bytes())  # fmt: skip
    assert shards["jsonl"][0] == 240 - len(BAD)
    for fmt in FORMATS[1:]:
        assert shards[fmt] == shards["jsonl"], fmt


@pytest.mark.slow
def test_every_format_trains_each_document_exactly_once(procs, tmp_path, port, tok):
    """One run over six files, one per format (record ids run on across them), two producers."""
    docs = builtin_docs(600)
    bad = {17, 140, 233, 333, 505}
    for i in bad:
        docs[i] = None
    paths = [
        str(write(tmp_path / f"part{k}", docs[100 * k : 100 * (k + 1)], fmt, rows_per_group=16))
        for k, fmt in enumerate(("jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-file", "hf"))
    ]
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", *paths, "--epochs", "1", "--steps", "0", "--seq-len", "64", "--batch-size", "8",
        "--shuffle-window", "64", "--port", str(port), "--metrics-port", "-1", "--log-every", "20",
        "--doc-log", str(log), "--summary-json", str(summary), "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=240) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0 and out["stale"] == 0
    good = {i: d for i, d in enumerate(docs) if d is not None}
    assert_exactly_once(read_doc_log(log), token_lengths(tok, good))
    text = procs.log(p)
    assert f"{paths[0]}:18: not valid JSON" in text  # record 17 is line 18 of the first file
    assert f"{paths[2]}:row 33: text is null" in text  # record 233 - 200
    assert f"{paths[3]}:row 33: text is null" in text
    assert f"{paths[5]}/data-00000-of-00002.arrow:row 5: text is null" in text  # record 505
    assert np.isfinite(out["last_loss"])
