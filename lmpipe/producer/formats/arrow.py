"""Arrow IPC files, stream or file format (what Hugging Face `datasets` writes), a record batch at a time.

Each batch's column is checked (offsets inside their buffers) before a value is read: a damaged one read
as it is ends the process (a bus error) where this can say which. Such a batch is one bad record naming
the file and the batch, its rows read past; a batch that cannot be read at all stops the reader in one line.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from lmpipe.producer.formats.changes import check_unchanged
from lmpipe.producer.formats.columns import text_column_of
from lmpipe.producer.formats.kinds import Damaged, DataFile
from lmpipe.producer.formats.parquet import said
from lmpipe.producer.remote import BLOCK, RangeReader


def arrow_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str] | Damaged]:
    import pyarrow as pa

    if f.remote is None:
        source = pa.memory_map(f.path)
    else:  # IPC streams are read message by message: buffer, so each message is not its own request
        source = io.BufferedReader(RangeReader(f.remote, f.path, f.size), BLOCK)
    with source:
        head = source.read(6)
        source.seek(0)
        # checked before each batch is read: a page of the memory map that a truncation cut off kills the
        # process (SIGBUS) where this can say why
        if head == b"ARROW1":
            reader = pa.ipc.open_file(source)
            name, kind = text_column_of(f, reader.schema, text_column)
            for k in range(reader.num_record_batches):
                check_unchanged(f, routine=True)
                yield _checked(reader.get_batch(k), name, kind, k)
        else:
            stream = pa.ipc.open_stream(source)
            name, kind = text_column_of(f, stream.schema, text_column)
            k = 0
            while True:
                check_unchanged(f, routine=True)
                try:
                    batch = stream.read_next_batch()
                except StopIteration:
                    return
                yield _checked(batch, name, kind, k)
                k += 1


def _checked(batch: Any, name: str, kind: str, k: int) -> tuple[Any, str] | Damaged:
    """Batch k's column, or a Damaged when its buffers fail their checks."""
    import pyarrow as pa

    col = batch.column(name)
    # as bytes: a row of invalid UTF-8 is that row's bad record (tables._rows), not the whole batch's
    as_bytes = {"string": pa.binary(), "large_string": pa.large_binary(), "string_view": pa.binary_view()}
    try:
        (col.view(as_bytes[str(col.type)]) if str(col.type) in as_bytes else col).validate(full=True)
    except pa.ArrowException as exc:
        return Damaged(batch.num_rows, f"record batch {k}", said(exc))
    return col, kind
