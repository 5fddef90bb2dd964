"""Which column of a table (Parquet, Arrow) holds its records, and of what kind.

Tables are read from the column named `text_column` ("text" by default: string or binary), or, when there
is no "text" column, from pre-tokenized "ids" or "input_ids" (lists of integers).
"""

from __future__ import annotations

import logging
from typing import Any

from lmpipe.producer.formats.kinds import DataFile, FormatError

log = logging.getLogger("lmpipe.producer")
IDS_COLUMNS = ("ids", "input_ids")
MASK_COLUMNS = ("labels", "loss_mask")  # what a tokenized fine-tuning table marks its trained tokens with
_said_unmasked: set[str] = set()
_said_unread: set[str] = set()  # files whose text column is read over ids or prompt columns, said once


def text_column_of(f: DataFile, schema: Any, text_column: str, say: bool = True) -> tuple[str, str]:
    """(column name, kind): kind is "str", "bytes" or "ids". `say`: warn of the columns not read (when the
    file is read, not when it is checked at the start: said in corpus order)."""
    import pyarrow as pa

    names = list(schema.names)
    candidates = [text_column] + (list(IDS_COLUMNS) if text_column == "text" else [])
    name = next((c for c in candidates if c in names), None)
    if name is None:
        hint = (
            "; prompt/completion records (loss masks) are read from JSONL only: write the table as JSON "
            'Lines, one {"prompt": ..., "completion": ...} object per row'
            if {"prompt", "completion"} <= set(names) and text_column == "text"
            else ""
        )
        raise FormatError(
            f"{f}: no column {text_column!r} (columns: {', '.join(names)}); name the text column "
            f"(--text-column){hint}"
        )
    unread = [c for c in (*IDS_COLUMNS, "prompt", "completion") if c in names and c != name]
    if say and name == text_column and unread and str(f) not in _said_unread:
        _said_unread.add(str(f))
        ids = next((c for c in unread if c in IDS_COLUMNS), None)
        log.warning("%s: column %r is tokenized; %s not read%s", f, name, ", ".join(map(repr, unread)),
                    f" (--text-column {ids} trains the ids as they are)" if ids else "")  # fmt: skip
    masks = [c for c in MASK_COLUMNS if c in names]
    if say and masks and name in IDS_COLUMNS and str(f) not in _said_unmasked:
        _said_unmasked.add(str(f))  # once per file and process: files are reopened every epoch
        log.warning(
            "%s: column %r is not read: every token of %r is trained (loss masks come from JSONL records "
            "with ids and loss_mask)",
            f,
            masks[0],
            name,
        )
    t = schema.field(name).type
    if pa.types.is_dictionary(t):  # pandas' category columns: the kind of their values (_rows decodes them)
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view":
        return name, "str"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or str(t) == "binary_view":
        return name, "bytes"
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type):
        return name, "ids"
    raise FormatError(
        f"{f}: column {name!r} is {t}, not text (string/binary) or token ids (list of integers)"
    )
