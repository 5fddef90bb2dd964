"""Parquet, Arrow, Hugging Face save_to_disk folders and gzip/zstd JSONL: the same records as plain JSONL,
bad rows named by file and row, broken files stopped with one line, every format through `lmpipe prepare`
and through a real run (every document's tokens trained exactly once)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import struct
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lmpipe.producer import formats
from lmpipe.producer.formats import FormatError
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from tests.corpora import FORMATS, builtin_docs, write, write_hf_dataset

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
    # (a corpus without its column is refused at the start now, so the default one has no fingerprint)
    assert Corpus([str(path)], text_column="content").fingerprint().endswith("|column=content")
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
    with pytest.raises(FormatError, match=r"cut\.parquet: unreadable Parquet file: its footer"):
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


def _said_count(exc: pytest.ExceptionInfo) -> int:
    found = re.search(r"truncated or corrupt past its first ([\d,]+) decompressed bytes", str(exc.value))
    assert found, str(exc.value)
    return int(found.group(1).replace(",", ""))


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
@pytest.mark.parametrize("size", [5_000, 1_200_000])
def test_a_truncated_stream_says_the_bytes_decompressed_before_the_error(tmp_path, compression, size):
    """A .gz cut at 90% of a 1.1 MB text file said "past its first 0 decompressed bytes" though 1 MB
    decodes: GzipFile fills the reader's whole 1 MiB buffer and drops what it decoded when it fails. The
    count is now every byte decompressed before the error: what a decompressor given the cut file yields."""
    text = b"".join(
        f"= Heading {i} =\n\n paragraph {i} of words {i * 7} and more\n\n".encode() for i in range(20_000)
    )
    text = text[:size]
    blob = gzip.compress(text) if compression == "gzip" else zstandard.ZstdCompressor().compress(text)
    cut = blob[: len(blob) * 9 // 10]
    d = zlib.decompressobj(31) if compression == "gzip" else zstandard.ZstdDecompressor().decompressobj()
    decodes = len(d.decompress(cut))  # all a decompressor yields of the cut stream
    assert (
        decodes < len(text) and not d.eof and (decodes > 0 or compression == "zstd")
    )  # (zstd: whole blocks)
    path = tmp_path / f"cut.txt.{'gz' if compression == 'gzip' else 'zst'}"
    path.write_bytes(cut)
    with pytest.raises(
        FormatError, match=rf"^{re.escape(str(path))}: {compression} data is truncated or corrupt"
    ) as e:
        list(formats.open_binary(formats.resolve([str(path)])[0]))
    assert _said_count(e) == decodes


def test_a_text_file_named_as_compressed_says_it_is_not_that_data(tmp_path):
    """A text file named .zst was "zstd data is truncated or corrupt" (.gz: the same, "Not a gzipped file" in
    brackets): no magic number at its start is not damage, it is not zstd (gzip) data. Junk after a valid
    frame (member) is still corrupt data past what decoded; a skippable zstd frame is read past."""
    text = b"hello world\nthis is text\n"
    for name, what in (("a.txt.zst", r"zstd data, though named \.zst \(Not a zstd file \(b'hell'\)\)"),
                       ("a.txt.gz", r"gzip data, though named \.gz \(Not a gzipped file \(b'he'\)\)")):  # fmt: skip
        (tmp_path / name).write_bytes(text)
        with pytest.raises(
            FormatError,
            match=rf"^{re.escape(str(tmp_path / name))}: not {what}; a file's format comes from its name",
        ):
            read(tmp_path / name)
    frame = zstandard.ZstdCompressor().compress(text)
    (tmp_path / "junk.txt.zst").write_bytes(frame + b"trailing junk")
    with pytest.raises(
        FormatError,
        match=rf"junk\.txt\.zst: zstd data is truncated or corrupt past its first {len(text)} decompressed "
        r"bytes \(Not a zstd file \(b'trai'\)\)",
    ):
        list(formats.open_binary(formats.resolve([str(tmp_path / "junk.txt.zst")])[0]))
    skippable = struct.pack("<II", 0x184D2A5E, 3) + b"abc"
    (tmp_path / "skip.txt.zst").write_bytes(skippable + frame + skippable + frame)
    assert [r[1] for r in read(tmp_path / "skip.txt.zst", doc_split="line")] == [
        "hello world", "this is text", "hello world", "this is text"
    ]  # fmt: skip


def test_a_truncated_gz_in_a_data_folder_is_refused_when_the_corpus_opens(tmp_path):
    """The start-up check (a Corpus opened by `lmpipe run` before the producers start) read only the first
    file's first record, and refuse_binary let a decoding error pass, so a folder whose second file is a
    truncated .gz started the run and its producers failed (exit 1, not 2). Damage within what refuse_binary
    decompresses (open_binary's first 1 MiB) is now refused there, by name."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("a good document\n\nand another\n")
    blob = gzip.compress(b"".join(f"document {i}\n\n".encode() for i in range(50_000)))
    (folder / "b.txt.gz").write_bytes(blob[: len(blob) * 9 // 10])
    with pytest.raises(
        FormatError, match=rf"^{re.escape(str(folder / 'b.txt.gz'))}: gzip data is truncated or corrupt past"
    ):
        Corpus([str(folder)])


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
