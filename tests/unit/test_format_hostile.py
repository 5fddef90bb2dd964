"""Hostile input for every format reader: each record that cannot be read is a bad record naming its file and
line (or row), counted and skipped; the file's other records are read; a file that cannot be read at all is
refused in one line naming it. Nothing escapes as an exception from inside the reader, whichever command
reads (run, produce, prepare and tokenizer train share the readers: prepare and tokenizer train are run
here through the command line's main)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lmpipe.cli import main
from lmpipe.producer.formats import FormatError
from lmpipe.producer.sources import Corpus

GOOD = b'{"text": "a good document"}\n'
HUGE_INT = b"9" * 5000  # past Python's 4,300-digit limit: json.loads raised a plain ValueError

# (name, JSON Lines content, reason of line 1 or None for a good record); line 2 is always GOOD
JSONL = [
    ("huge int", b'{"text": "hi", "n": ' + HUGE_INT + b"}", "bad_json"),
    ("huge int in ids", b'{"ids": [' + HUGE_INT + b"]}", "bad_json"),
    ("huge int in a mask", b'{"ids": [1], "loss_mask": [' + HUGE_INT + b"]}", "bad_json"),
    ("huge negative int", b'{"text": "hi", "n": -' + HUGE_INT + b"}", "bad_json"),
    ("huge float", b'{"text": "hi", "n": 1' + b"0" * 5000 + b".5e99999}", None),
    ("deep arrays", b'{"text": "hi", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "bad_json"),
    ("deep objects", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "bad_json"),
    ("a number", b"5", "bad_json"),
    ("a string", b'"text"', "bad_json"),
    ("null", b"null", "bad_json"),
    ("an array", b'[{"text": "hi"}]', "bad_json"),
    ("text a number", b'{"text": 5}', "missing_text"),
    ("text null", b'{"text": null}', "missing_text"),
    ("text a list", b'{"text": ["a", "b"]}', "missing_text"),
    ("text an object", b'{"text": {"a": 1}}', "missing_text"),
    ("text a boolean", b'{"text": true}', "missing_text"),
    ("ids negative", b'{"ids": [1, -1]}', "bad_ids"),
    ("ids booleans", b'{"ids": [true, false]}', "bad_ids"),
    ("ids floats", b'{"ids": [1.0]}', "bad_ids"),
    ("ids past int64", b'{"ids": [99999999999999999999999]}', "bad_ids"),
    ("ids past the vocabulary", b'{"ids": [1000000]}', "bad_ids"),
    ("ids nested", b'{"ids": [[1]]}', "bad_ids"),
    ("ids with null", b'{"ids": [1, null]}', "bad_ids"),
    ("ids a string", b'{"ids": "1 2 3"}', "missing_text"),
    ("ids empty", b'{"ids": []}', "empty"),
    ("mask booleans", b'{"ids": [1], "loss_mask": [true]}', "bad_mask"),
    ("mask a string", b'{"ids": [1], "loss_mask": "1"}', "bad_mask"),
    ("prompt a number", b'{"prompt": 5, "completion": "a"}', "bad_prompt"),
    ("lone surrogate", b'{"text": "a \\ud800 b"}', "invalid_utf8"),
    ("lone low surrogate in a prompt", b'{"prompt": "\\udfff", "completion": "a"}', "invalid_utf8"),
    ("surrogate pair", b'{"text": "\\ud83d\\ude00"}', None),
    ("escaped NUL", b'{"text": "a\\u0000b"}', None),
    ("raw NUL in a string", b'{"text": "a\x00b"}', "bad_json"),
    ("invalid UTF-8", b'{"text": "caf\xe9"}', "invalid_utf8"),
    ("UTF-8 of a surrogate", b'{"text": "\xed\xa0\x80"}', "invalid_utf8"),
    ("bad JSON", b'{"text": "hi"', "bad_json"),
]
COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}


def _read(path: Path, **kw) -> list[tuple[str, str | None]]:
    """(where after the folder, bad reason or None) of every record."""
    return [(r.where.rsplit("/", 1)[-1], r.bad and r.bad[0]) for r in Corpus([str(path)], **kw).records()]


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize(("name", "line", "reason"), JSONL, ids=[c[0] for c in JSONL])
def test_a_hostile_json_line_is_one_bad_record_naming_file_and_line(tmp_path, suffix, name, line, reason):
    # a raw NUL near a file's start makes the whole file binary (refused at the start): put it past the probe
    pad = b'{"text": "padding"}\n' * (500 if b"\x00" in line else 0)
    path = tmp_path / f"c.jsonl{suffix}"
    path.write_bytes(COMPRESS[suffix](pad + line + b"\n" + GOOD))
    got = _read(path, vocab_size=1000)[-2:]
    n = len(pad.splitlines())
    assert got == [(f"c.jsonl{suffix}:{n + 1}", reason), (f"c.jsonl{suffix}:{n + 2}", None)]


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_hostile_text_lines_are_bad_records_naming_file_and_line(tmp_path, suffix):
    """Plain text, --doc-split line: a line of invalid UTF-8, of UTF-8 for a surrogate, with a NUL byte (past
    the probe that refuses a binary file), or over --max-line-bytes is its own bad record."""
    pad = b"padding line\n" * 1000
    lines = [b"caf\xe9", b"\xed\xa0\x80", b"a\x00b", b"x" * 5000, b"good line"]
    path = tmp_path / f"t.txt{suffix}"
    path.write_bytes(COMPRESS[suffix](pad + b"\n".join(lines) + b"\n"))
    got = [(r.where.rsplit(":", 1)[-1], r.bad and r.bad[0]) for r in
           Corpus([str(path)], doc_split="line", max_line_bytes=4096).records()][-5:]  # fmt: skip
    reasons = ["invalid_utf8", "invalid_utf8", "binary", "line_too_long", None]
    assert got == [(str(1001 + i), r) for i, r in enumerate(reasons)]


def test_a_key_with_a_lone_surrogate_is_said_escaped(tmp_path):
    """Named in missing_text's hint, it could not be written to the log (UnicodeEncodeError)."""
    path = tmp_path / "k.jsonl"
    path.write_bytes(b'{"\\ud800": "x"}\n')
    (rec,) = Corpus([str(path)]).records()
    assert rec.bad is not None and "\\ud800" in rec.bad[1]
    rec.bad[1].encode("utf-8")


def test_empty_and_truncated_streams(tmp_path):
    for suffix in COMPRESS:
        (tmp_path / f"e.jsonl{suffix}").write_bytes(COMPRESS[suffix](b"") if suffix == ".gz" else b"")
        assert _read(tmp_path / f"e.jsonl{suffix}") == []
    data = GOOD * 100_000
    for suffix, cut in ((".gz", gzip.compress(data)[:-2000]), (".zst", COMPRESS[".zst"](data)[:-100])):
        (tmp_path / f"t.jsonl{suffix}").write_bytes(cut)
        with pytest.raises(FormatError, match=rf"t\.jsonl{suffix}: \w+ data is truncated or corrupt past"):
            _read(tmp_path / f"t.jsonl{suffix}")


def test_a_single_huge_document_is_one_document(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text(("word " * 200 + "\n") * 20_000)  # 20 MB, no blank line: one document
    (rec,) = Corpus([str(path)]).records()
    assert rec.bad is None and rec.text is not None and len(rec.text) > 19_000_000


def _write_table(path: Path, table: pa.Table) -> None:
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=2)
        return
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)


_LATIN1 = pa.array([b"ok", b"caf\xe9", b"fine"], pa.binary())
TABLE_ROWS = [
    (
        "string of invalid UTF-8",
        pa.Array.from_buffers(pa.string(), 3, _LATIN1.buffers()),
        [None, "invalid_utf8", None],
    ),  # fmt: skip
    (
        "large_string",
        pa.array(["a", None, "", "b"], pa.large_string()),
        [None, "missing_text", "empty", None],
    ),
    ("dictionary", pa.array(["a", "b", None, "a"]).dictionary_encode(), [None, None, "missing_text", None]),
    (
        "binary",
        pa.array([b"ok", b"caf\xe9", b"\xed\xa0\x80", b"a\x00b"], pa.binary()),
        [None, "invalid_utf8", "invalid_utf8", None],
    ),  # fmt: skip
    ("ids", pa.array([[1, 2], [-1], [2**40], None]), [None, "bad_ids", "bad_ids", "missing_text"]),
    ("uint64 ids", pa.array([[1], [2**64 - 1]], pa.list_(pa.uint64())), [None, "bad_ids"]),
    ("ids with null", pa.array([[1, None], []]), ["bad_ids", "empty"]),
]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize(("name", "column", "reasons"), TABLE_ROWS, ids=[c[0] for c in TABLE_ROWS])
def test_table_rows_of_every_column_type_are_records(tmp_path, fmt, name, column, reasons):
    key = "ids" if "ids" in name else "text"
    path = tmp_path / f"t.{fmt}"
    _write_table(path, pa.table({key: column}))
    assert _read(path, vocab_size=1000) == [(f"t.{fmt}:row {i}", r) for i, r in enumerate(reasons)]


TABLE_REFUSED = [
    ("struct", pa.array([{"a": 1}]), r"struct<a: int64>, not text"),
    ("list of strings", pa.array([["a", "b"]]), r"list<\w+: string>, not text"),
    ("list of booleans", pa.array([[True]]), r"list<\w+: bool>, not text"),
    ("all null", pa.array([None, None], pa.null()), "null, not text"),
    ("integers", pa.array([1, 2]), "int64, not text"),
]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
@pytest.mark.parametrize(("name", "column", "said"), TABLE_REFUSED, ids=[c[0] for c in TABLE_REFUSED])
def test_a_table_column_of_no_readable_type_is_refused_at_the_start(tmp_path, fmt, name, column, said):
    path = tmp_path / f"t.{fmt}"
    _write_table(path, pa.table({"text": column}))
    with pytest.raises(FormatError, match=rf"t\.{fmt}: column 'text' is {said}"):
        Corpus([str(path)])


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_an_empty_table_file_is_refused_at_the_start_naming_it(tmp_path, fmt):
    (tmp_path / f"e.{fmt}").write_bytes(b"")
    with pytest.raises(FormatError, match=rf"e\.{fmt}: unreadable {fmt.capitalize()} file"):
        Corpus([str(tmp_path / f"e.{fmt}")])


def _parquet(path: Path, rows: int = 3000, group: int = 1000) -> list[str]:
    texts = [f"document {i} " + "word " * (i % 50) for i in range(rows)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=group, compression="snappy")
    return texts


def test_a_damaged_parquet_row_group_is_one_bad_record_and_the_rest_is_read(tmp_path):
    """pyarrow's "Couldn't deserialize thrift" is an OSError, which stopped the producer naming no file."""
    good = tmp_path / "good.parquet"
    texts = _parquet(good)
    chunk = pq.ParquetFile(good).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(good.read_bytes())
    for k in range(start, start + chunk.total_compressed_size, 7):  # its pages' headers and data
        data[k] ^= 0x5A
    path = tmp_path / "d.parquet"
    path.write_bytes(data)
    recs = list(Corpus([str(path)]).records())
    bad = [r for r in recs if r.bad is not None]
    assert len(bad) == 1 and bad[0].rid == 1000 and bad[0].bad is not None
    assert bad[0].where == f"{path}:row group 1 (row 1000-1999)" and bad[0].bad[0] == "damaged"
    good_recs = [r for r in recs if r.bad is None]
    assert [r.text for r in good_recs] == texts[:1000] + texts[2000:]
    assert [r.rid for r in good_recs] == list(range(1000)) + list(range(2000, 3000))  # ids as dataset[R]
    shares = [list(Corpus([str(path)]).records(w, 3)) for w in range(3)]  # 3 workers: said once
    assert sum(r.bad is not None for s in shares for r in s) == 1
    assert sorted(r.rid for s in shares for r in s) == [r.rid for r in recs]


def test_a_parquet_file_whose_footer_is_cut_is_refused_in_one_line_at_the_start(tmp_path):
    good = tmp_path / "good.parquet"
    _parquet(good)
    blob = good.read_bytes()
    cases = {
        "footer.parquet": blob[:-40] + blob[-8:],  # part of the footer gone, its length and magic kept
        "half.parquet": blob[: len(blob) // 2],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(FormatError, match=rf"{name}: unreadable Parquet file: its footer .* re-download"):
            Corpus([str(tmp_path / name)])


def test_an_arrow_batch_with_offsets_out_of_bounds_is_one_bad_record_not_a_bus_error(tmp_path):
    good = pa.array(["abc", "def", "ghi"])
    offsets = pa.py_buffer(np.array([0, 3, 1 << 30, 9], dtype=np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), 3, [None, offsets, good.buffers()[2]])
    schema = pa.schema([("text", pa.string())])
    path = tmp_path / "o.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for col in (good, bad, good):
            w.write_batch(pa.record_batch([col], schema=schema))
    got = _read(path)
    assert got == [(f"o.arrow:row {i}", None) for i in range(3)] + [
        ("o.arrow:record batch 1 (row 3-5)", "damaged")
    ] + [(f"o.arrow:row {i}", None) for i in range(6, 9)]


def _hostile_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "h.jsonl"
    lines = [line for _, line, _ in JSONL if b"\x00" not in line] + [GOOD.strip()] * 5
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_prepare_skips_counts_and_names_file_and_line(tmp_path, capsys):
    path = _hostile_corpus(tmp_path)
    assert main(["prepare", "--data", str(path), "--out", str(tmp_path / "shards")]) == 0
    out, err = capsys.readouterr()
    assert f"{path}:1: an integer of more than 4,300 digits, which is not parsed (bad_json), skipped" in err
    assert "Traceback" not in err and "Exceeds the limit" not in err
    good = sum(reason is None for _, line, reason in JSONL if b"\x00" not in line) + 5
    bad = len([line for _, line, _ in JSONL if b"\x00" not in line]) + 5 - good
    assert f"wrote {tmp_path / 'shards'}: {good} documents" in out
    assert f"; {bad} bad records skipped (" in out


def test_tokenizer_train_reads_past_hostile_records(tmp_path, capsys):
    path = _hostile_corpus(tmp_path)
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", str(path), "--out", str(out), "--vocab-size", "300"]) == 0
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    assert "Exceeds the limit" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        (
            "state.json",
            '{"_data_files": [{"filename": 5}]}',
            r"state\.json: not a Hugging Face dataset state",
        ),
        (
            "state.json",
            '{"_data_files": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"state\.json: not a Hugging",
        ),
        ("dataset_dict.json", '{"splits": 5}', r"a Hugging Face DatasetDict \(splits: \?\)"),
        ("dataset_dict.json", '{"splits": [{"a": 1}]}', r"a Hugging Face DatasetDict \(splits: \?\)"),
    ],
    ids=["a number for a file name", "nested too deep", "splits a number", "splits of objects"],
)
def test_a_hand_edited_hugging_face_folder_is_refused_in_one_line(tmp_path, name, content, said):
    """A TypeError (joining a number) or RecursionError escaped as a traceback."""
    (tmp_path / name).write_text(content)
    with pytest.raises(FormatError, match=said):
        Corpus([str(tmp_path)])
