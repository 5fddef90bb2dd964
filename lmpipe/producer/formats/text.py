"""Plain-text documents.

A document is a block of non-blank lines (`--doc-split blank`, the default), everything from one top-level
` = Heading = ` line to the next (`--doc-split heading`, WikiText's article layout), or every non-blank
line (`--doc-split line`: one sentence per line, Penn Treebank style). Lines end at \n (a \r before it is
dropped); a file whose first line holds \r but no \n (CR line endings, old Mac) is said once per file,
since it reads as one line. A UTF-8 BOM at a file's first byte is dropped. A line that is not UTF-8, holds
a NUL byte or is over --max-line-bytes is skipped and reported with file and line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.formats.lines import CR_HINT, read_lines
from lmpipe.producer.records import Record

DOC_SPLITS = ("blank", "heading", "line")
HEADING = re.compile(r"^ = [^=].* = $")


def _preamble(rec: Record, seen_heading: bool) -> bool:
    """The blank lines before a file's first heading (WikiText's preamble; heading split only: elsewhere a
    blank line is no record): not a document the user wrote, so no record at all rather than a bad one."""
    return not seen_heading and rec.bad is not None and rec.bad[0] == "empty"


def text_records(
    path: Path | DataFile,
    first_rid: int,
    doc_split: str,
    max_line_bytes: int,
    notes: dict[str, bool] | None = None,
) -> Iterator[Record]:
    rid = first_rid
    lines: list[str] = []
    warnings: list[tuple[str, str, str]] = []
    start = 0
    seen_heading = False

    def flush() -> Record:
        text = "\n".join(lines).strip()
        rec = Record(rid=rid, text=text, where=f"{path}:{start}", warnings=warnings or None)
        if not text and warnings:  # nothing but skipped lines: one bad record, for its first line's reason
            reason, _, detail = warnings[0]
            rec.bad = (
                reason,
                detail + (f" (and {len(warnings) - 1} more line(s))" if len(warnings) > 1 else ""),
            )
            rec.warnings = None
        elif not text:
            rec.bad = ("empty", "document is empty")
        return rec

    notes = {} if notes is None else notes
    for lineno, raw, size in read_lines(path, max_line_bytes, notes):
        where = f"{path}:{lineno}"
        if raw is None:
            cr = f"; {CR_HINT}" if notes.get("cr") else ""
            too_long = f"line of {size:,} bytes exceeds --max-line-bytes {max_line_bytes:,}{cr}"
            line, problem = None, ("line_too_long", where, too_long)
        elif (nul := raw.find(b"\0")) >= 0:  # binary data past the file's probed head, or UTF-16 text
            line, problem = None, ("binary", where, f"a NUL byte at byte {nul}: binary data, not text")
        else:
            try:
                line, problem = raw.decode("utf-8"), None
            except UnicodeDecodeError as exc:
                line, problem = (
                    None,
                    (
                        "invalid_utf8",
                        where,
                        f"invalid UTF-8 at byte {exc.start} (is the file UTF-8? Latin-1 or Windows-1252 text "
                        "converts with iconv -f cp1252 -t utf-8)",
                    ),
                )
        if line is not None:
            blank = not line.strip()
            if doc_split == "heading":
                boundary = bool(HEADING.match(line))
            else:  # blank: a blank line ends a document; line: every line is one
                boundary = blank or doc_split == "line"
            if boundary and (lines or warnings):
                if not _preamble(rec := flush(), seen_heading):  # its record id stays used all the same
                    yield rec
                rid += 1
                lines, warnings = [], []
            seen_heading |= boundary  # (read by _preamble in heading mode only)
            if doc_split != "heading" and blank:
                continue
        elif doc_split == "line" and (lines or warnings):  # a skipped line is a document too: its own record
            yield flush()
            rid += 1
            lines, warnings = [], []
        if not lines and not warnings:
            start = lineno
        if line is None:
            assert problem is not None  # a line is skipped only for a reason
            warnings.append(problem)
        else:
            lines.append(line)
    if lines or warnings:
        yield flush()
