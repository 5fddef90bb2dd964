"""Parquet files, a batch of rows of the text column at a time, row group by row group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmpipe.producer.formats.columns import text_column_of
from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.remote import RangeReader

ROWS_PER_BATCH = 4096  # rows decoded at a time from a Parquet row group


def parquet_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq

    source = f.path if f.remote is None else RangeReader(f.remote, f.path, f.size)
    pf = pq.ParquetFile(source, pre_buffer=False)  # pre-buffering reads every row group up front
    name, kind = text_column_of(f, pf.schema_arrow, text_column)
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=[name], use_threads=False):
        yield batch.column(0), kind
