"""Corpus files: which ones a `--data` path stands for, what format each is in, and a reader per format.

  kinds       a file's format and compression, from its name or first bytes (DataFile, FormatError)
  resolve     the files --data paths stand for, each once (a folder's, a glob's, a URL's)
  hf          Hugging Face `save_to_disk` folders, by their state.json
  changes     whether a file is still as the run found it (CorpusChanged)
  compressed  a text or JSONL file's bytes, gzip or zstd decompressed as they stream
  lines       its lines, bounded by --max-line-bytes
  text        plain-text documents (--doc-split)
  jsonl       JSON Lines records
  binary      refusing a text or JSONL file that is not text, at the start
  tables      Parquet and Arrow rows (parquet, arrow: their batches)

Every reader yields one Record per record, good or bad: a record that cannot be read (invalid UTF-8,
broken JSON, a wrong type, a damaged row group) is a bad record naming its file and line (or row), counted
and skipped by the caller; only a file that cannot be read at all stops the reader, in one line naming it.
pyarrow (lmpipe[parquet]) and zstandard (lmpipe[zstd]) are needed only for the files that use them.
"""

from lmpipe.producer.formats.binary import refuse_binary
from lmpipe.producer.formats.changes import _check_object, check_objects, check_unchanged
from lmpipe.producer.formats.compressed import NotCompressed, open_binary
from lmpipe.producer.formats.jsonl import jsonl_records
from lmpipe.producer.formats.kinds import (
    TABLES,
    CorpusChanged,
    DataFile,
    FormatError,
    magic,
    read_from_dir,
    require_extras,
)
from lmpipe.producer.formats.lines import CR_HINT
from lmpipe.producer.formats.resolve import left_out, local_folder, resolve
from lmpipe.producer.formats.tables import check_table, table_records
from lmpipe.producer.formats.text import DOC_SPLITS, text_records

__all__ = [
    "CR_HINT",
    "DOC_SPLITS",
    "TABLES",
    "CorpusChanged",
    "DataFile",
    "FormatError",
    "NotCompressed",
    "_check_object",  # bench/object_checks.py times it
    "check_objects",
    "check_table",
    "check_unchanged",
    "jsonl_records",
    "left_out",
    "local_folder",
    "magic",
    "open_binary",
    "read_from_dir",
    "refuse_binary",
    "require_extras",
    "resolve",
    "table_records",
    "text_records",
]
