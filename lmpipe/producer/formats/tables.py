"""Records of tables (Parquet, Arrow): one per row.

Tables are read from the column named `text_column` ("text" by default: string or binary), or, when there
is no "text" column, from pre-tokenized "ids" or "input_ids" (lists of integers). Row r of a table is one
record; a null, empty, non-UTF-8 or out-of-vocabulary row is a bad record named `FILE:row R` (R counts from
0 in that file, as `dataset[R]` does), counted and skipped like a bad line.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from lmpipe.producer.formats.arrow import arrow_batches
from lmpipe.producer.formats.changes import check_unchanged
from lmpipe.producer.formats.columns import text_column_of
from lmpipe.producer.formats.kinds import Damaged, DataFile, FormatError
from lmpipe.producer.formats.parquet import open_parquet, parquet_batches, said
from lmpipe.producer.remote import RemoteError

log = logging.getLogger("lmpipe.producer")


def _rows(col: Any, kind: str, first: int, worker: int, num_workers: int, row0: int, f: DataFile,
          vocab_size: int | None, make) -> Iterator:  # fmt: skip
    """Records of the rows of `col` this worker owns; row i of `col` has record id first + i."""
    import pyarrow as pa

    start = (worker - first) % num_workers
    if start >= len(col):
        return
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if num_workers > 1:  # materialize only this worker's rows
        col = col.take(pa.array(np.arange(start, len(col), num_workers)))
    values: list[Any]
    if kind == "str":
        try:
            values = col.to_pylist()
        except UnicodeDecodeError:  # the file holds invalid UTF-8 in a string column: row by row
            as_bytes = {"large_string": pa.large_binary(), "string_view": pa.binary_view()}
            values = col.view(as_bytes.get(str(col.type), pa.binary())).to_pylist()
            kind = "bytes"
    else:
        values = col.to_pylist()
    limit = vocab_size or (1 << 31)
    for j, v in enumerate(values):
        i = start + j * num_workers
        rec = make(rid=first + i, where=f"{f}:row {row0 + i}")
        if v is None:
            rec.bad = ("missing_text", f"{'ids' if kind == 'ids' else 'text'} is null")
        elif kind == "ids":
            try:  # a null inside the list, or an unsigned id past int64, is this row's problem only
                ids = np.asarray(v, dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                rec.bad = ("bad_ids", f"ids must be integers in [0, {limit}), not {str(v)[:60]}")
                yield rec
                continue
            if not ids.size:
                rec.bad = ("empty", "empty ids")
            elif ids.min() < 0 or ids.max() >= limit:
                rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
            else:
                rec.ids = ids
        else:
            if kind == "bytes":
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError as exc:
                    rec.bad = ("invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
                    yield rec
                    continue
            rec.text = v
            if not v.strip():
                rec.bad = ("empty", "empty text")
        yield rec


def table_records(f: DataFile, first_rid: int, worker: int, num_workers: int, *, text_column: str,
                  vocab_size: int | None, make) -> Generator[Any, None, int]:  # fmt: skip
    """Records of a Parquet or Arrow file that this worker owns (`make` builds a Record); returns the
    record id after the file's last row."""
    import pyarrow as pa

    batches = parquet_batches(f, text_column) if f.fmt == "parquet" else arrow_batches(f, text_column)
    row = 0
    try:
        for part in batches:
            if isinstance(part, Damaged):
                check_unchanged(f)  # a file rewritten since the start is not a damaged one
                if (first_rid + row) % num_workers == worker:  # said by the worker owning its first row
                    yield _damaged(part, first_rid + row, row, f, make)
                row += part.rows
                continue
            col, kind = part
            yield from _rows(col, kind, first_rid + row, worker, num_workers, row, f, vocab_size, make)
            row += len(col)
    except (OSError, pa.ArrowException) as exc:  # a damaged page is a plain OSError
        if isinstance(exc, RemoteError):
            raise
        check_unchanged(f)  # a file rewritten since the start is not a damaged one
        raise FormatError(
            f"{f}: unreadable {f.fmt.capitalize()} data after row {row} ({said(exc)}); "
            "re-download or re-create the file"
        ) from None
    check_unchanged(f, routine=True)  # the whole pass read the file as it was
    return first_rid + row


def _damaged(part: Damaged, rid: int, row: int, f: DataFile, make) -> Any:
    """One bad record for the rows of `part`, from `row` on: its first row's id, named by the part."""
    last = f"-{row + part.rows - 1}" if part.rows > 1 else ""
    rec = make(rid=rid, where=f"{f}:{part.part} (row {row}{last})")
    rec.bad = (
        "damaged",
        f"{part.rows:,} row(s) cannot be decoded ({part.why}); the rest of the file is read",
    )
    return rec


def check_table(f: DataFile, text_column: str) -> None:
    """A local table's footer (Parquet) or schema (Arrow) can be read and names a column to read: a file
    that cannot be read at all is refused at the start in one line naming it, as an unreadable or binary
    file is, before any process waits on its batches. Damage inside is found, and read past, later."""
    import pyarrow as pa

    if f.fmt == "parquet":
        text_column_of(f, open_parquet(f).schema_arrow, text_column, say=False)
        return
    try:
        with pa.memory_map(f.path) as source:
            head = source.read(6)
            source.seek(0)
            ipc = pa.ipc.open_file if head == b"ARROW1" else pa.ipc.open_stream
            schema = ipc(source).schema
    except (OSError, pa.ArrowException) as exc:
        raise FormatError(
            f"{f}: unreadable Arrow file: its schema cannot be read ({said(exc)}); "
            "re-download or re-create the file"
        ) from None
    text_column_of(f, schema, text_column, say=False)
