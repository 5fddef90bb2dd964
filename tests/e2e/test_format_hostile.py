"""`lmpipe prepare`, as a process, on a folder holding a JSON line with a 5,000-digit integer and a Parquet file
with a damaged row group: both are skipped, counted and named (file and line, file and row group), the rest
is prepared. Each stopped the command before, in a line naming neither file nor line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from lmpipe.producer.shards import ShardSet
from tests.helpers import run_lmpipe


def test_prepare_skips_a_huge_integer_and_a_damaged_row_group_naming_each(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": f"document {i} of the JSON lines"}) for i in range(10)]
    lines[3] = '{"text": "hi", "n": ' + "9" * 5000 + "}"
    (data / "a.jsonl").write_text("\n".join(lines) + "\n")
    texts = [f"row {i} of the table " + "word " * (i % 20) for i in range(300)]
    table = data / "b.parquet"
    pq.write_table(pa.table({"text": texts}), table, row_group_size=100, compression="snappy")
    chunk = pq.ParquetFile(table).metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    blob = bytearray(table.read_bytes())
    for k in range(start, start + chunk.total_compressed_size, 7):
        blob[k] ^= 0x5A
    table.write_bytes(blob)

    out = tmp_path / "shards"
    rc, log = run_lmpipe(tmp_path, "prepare", "prepare", "--data", str(data), "--out", str(out))
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log and "Exceeds the limit" not in log
    assert (
        f"{data / 'a.jsonl'}:4: an integer of more than 4,300 digits, which is not parsed (bad_json)" in log
    )
    assert f"{table}:row group 1 (row 100-199): 100 row(s) cannot be decoded (" in log
    assert "2 bad records skipped (1 bad_json, 1 damaged)" in log
    shards = ShardSet(out)
    assert len(shards) == 9 + 200
    assert sorted(int(r) for r in shards.rids) == [
        *range(3),
        *range(4, 10),
        *range(10, 110),
        *range(210, 310),
    ]
