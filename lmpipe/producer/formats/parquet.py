"""Parquet files, a batch of rows of the text column at a time, row group by row group.

A row group that cannot be decoded (a damaged page: pyarrow's "Couldn't deserialize thrift") is skipped as
one bad record naming the file and the group, its rows counted as read so that the record ids of the rows
after it stay `dataset[R]`'s; the other groups are read. A footer that cannot be read leaves nothing to
read: the file is refused in one line naming it (at the start for a local file, see check_table).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmpipe.producer.formats.columns import text_column_of
from lmpipe.producer.formats.kinds import Damaged, DataFile, FormatError
from lmpipe.producer.remote import RangeReader, RemoteError

ROWS_PER_BATCH = 4096  # rows decoded at a time from a Parquet row group


def open_parquet(f: DataFile) -> Any:
    """A ParquetFile over `f`, its footer read; FormatError naming the file when the footer is unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = f.path if f.remote is None else RangeReader(f.remote, f.path, f.size)
    try:
        return pq.ParquetFile(source, pre_buffer=False)  # pre-buffering reads every row group up front
    except (OSError, pa.ArrowException) as exc:  # a damaged footer is a plain OSError, not ArrowException
        if isinstance(exc, RemoteError):
            raise
        raise FormatError(
            f"{f}: unreadable Parquet file: its footer (the file's schema and row groups) cannot be read "
            f"({said(exc)}); re-download or re-create the file"
        ) from None


def parquet_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str] | Damaged]:
    """(column, kind) a batch at a time; a Damaged for the rest of a row group that cannot be decoded."""
    import pyarrow as pa

    pf = open_parquet(f)
    name, kind = text_column_of(f, pf.schema_arrow, text_column)
    for g in range(pf.metadata.num_row_groups):
        rows, done = pf.metadata.row_group(g).num_rows, 0
        batches = pf.iter_batches(
            batch_size=ROWS_PER_BATCH, row_groups=[g], columns=[name], use_threads=False
        )
        while True:
            try:
                batch = next(batches, None)
            except (OSError, pa.ArrowException) as exc:
                if isinstance(exc, RemoteError):
                    raise
                yield Damaged(rows - done, f"row group {g}", said(exc))
                break
            if batch is None:
                break
            done += batch.num_rows
            yield batch.column(0), kind


def said(exc: Exception) -> str:
    """pyarrow's message on one line, printable (a damaged page's message quotes its bytes), at most 200."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(exc)).split())
    return text if len(text) <= 200 else text[:200] + "..."
