"""Arrow IPC files, stream or file format (what Hugging Face `datasets` writes), a record batch at a time."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from lmpipe.producer.formats.changes import check_unchanged
from lmpipe.producer.formats.columns import text_column_of
from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.remote import BLOCK, RangeReader


def arrow_batches(f: DataFile, text_column: str) -> Iterator[tuple[Any, str]]:
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
                yield reader.get_batch(k).column(name), kind
        else:
            stream = pa.ipc.open_stream(source)
            name, kind = text_column_of(f, stream.schema, text_column)
            while True:
                check_unchanged(f, routine=True)
                try:
                    batch = stream.read_next_batch()
                except StopIteration:
                    return
                yield batch.column(name), kind
