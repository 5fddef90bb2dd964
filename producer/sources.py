"""Corpus readers: text, JSONL, Parquet, Arrow and the built-in corpus, each a stream of numbered records.

Every record gets an id: its index across all files in the order given. Good records are documents;
bad ones (invalid UTF-8, broken JSON, empty, over-long lines) are reported with file and line, counted by
reason, and skipped. Each record is reported by exactly one worker, the one that owns its id, so N
producers reading the same files do not report a bad line N times.

A directory written by `lmpipe prepare` (it holds meta.json) is read as pre-tokenized shards.
Plain text: a document is a block of non-blank lines (`--doc-split blank`, the default), everything
from one top-level ` = Heading = ` line to the next (`--doc-split heading`, WikiText's article layout), or
every non-blank line (`--doc-split line`: one sentence per line, Penn Treebank style). Lines end at \n
(a \r before it is dropped); a file whose first line holds \r but no \n (CR line endings, old Mac) is said
once per file, since it reads as one line. A UTF-8 BOM at a text or JSONL file's first byte is dropped.
A text or JSONL file with a NUL byte near its start is binary, not a corpus: it is refused by name, before any
process waits on batches that would be junk; so is one that is really gzip, zstd, Parquet or Arrow under a
text name, saying so.
JSONL: one object per line with a `text` string (or the key --text-column names), or pre-tokenized `ids` (a
list of token ids), or, to train on only some tokens (fine-tuning), a `prompt` and a `completion` string
(the loss is taken on the completion and the end-of-text token after it) or `ids` with a `loss_mask` of 0/1
per id (1: the model is trained to predict that token). A record with a mask is a document like any other; see Record.loss_mask.
A record with Hugging Face's per-token `labels` and no text is a bad record (`bad_mask`) that names those two
forms, as a table's `labels` column is warned about (formats.py): never its ids trained in full unsaid.
Compressed text/JSONL, Parquet, Arrow and Hugging Face `save_to_disk` folders: see formats.py; any of
them, and shards, can be a URL (s3://bucket/prefix, any fsspec URL): see remote.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmpipe.producer import builtin_corpus, formats
from lmpipe.producer.formats import DataFile
from lmpipe.producer.shards import ShardSet, is_shard_dir
from lmpipe.shared.config import MAX_LINE_BYTES, PipelineConfig
from lmpipe.shared.files import local_path

log = logging.getLogger("lmpipe.producer")
DRAIN_CHUNK = 1 << 20  # bytes read at a time while skipping an over-long line
# The corpus's files in its fingerprint, at most (characters), which travels in every hello (16 KiB, with
# the skipped counts): beyond it, their digest. 1,024 files named like C4's took 36 KB and were refused.
MAX_FINGERPRINT = 8192
_said_unread: set[str] = set()  # files whose records hold keys that are not read, said once
_said_cr: set[str] = set()  # files with CR line endings, said once

DOC_SPLITS = ("blank", "heading", "line")
HEADING = re.compile(r"^ = [^=].* = $")
BINARY_PROBE_BYTES = 8192  # how much of a file is looked at for NUL bytes (what git and grep do)

LOGGED_BAD_RECORDS = 10  # bad records a process logs one by one; the rest are counted


class BadRecords:
    """A process's bad records: the first LOGGED_BAD_RECORDS each get a line (file:line, what, why), then a
    line at 100, 1,000, ... says how many so far, so that a mis-encoded corpus cannot flood the log; every
    one is counted, by reason. `who`: whose count it is when the process does not read the whole corpus (a
    producer reads the shards it holds): "this producer skipped N bad records", not "N bad records skipped",
    which reads as the corpus's."""

    def __init__(self, log: logging.Logger, who: str = ""):
        self.log = log
        self.who = who
        self.counts: dict[str, int] = {}
        self.total = 0

    def __call__(self, reason: str, where: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.total += 1
        if self.total <= LOGGED_BAD_RECORDS:
            self.log.warning("%s: %s (%s), skipped", where, detail, reason)
            if self.total == LOGGED_BAD_RECORDS:
                self.log.warning("more bad records are counted, not logged one by one")
        elif self.total >= 100 and str(self.total).rstrip("0") == "1":
            self.log.warning("%s so far", self.summary())

    def summary(self) -> str:
        by = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.counts.items()))
        records = "bad record" if self.total == 1 else "bad records"
        if self.who:
            return f"{self.who} skipped {self.total:,} {records} ({by})"
        return f"{self.total:,} {records} skipped ({by})"


@dataclass
class Record:
    rid: int  # record id: index across the corpus
    text: str | None = None
    ids: list[int] | np.ndarray | None = None  # a JSON record's list, or a shard's array
    # 0/1 per token of `ids` (1: trained as a target, i.e. predicted from the tokens before it); None: all
    loss_mask: list[int] | np.ndarray | None = None
    # prompt/completion records: `text` is the completion; the prompt is context, never trained
    prompt: str | None = None
    where: str = ""  # file:line of the record's first line
    bad: tuple[str, str] | None = None  # (reason, detail) when the whole record is rejected
    warnings: list[tuple[str, str, str]] | None = None  # (reason, where, detail) for skipped lines inside


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors write at a file's start
CR_HINT = (
    "the file has CR line endings (\\r without \\n, old Mac style) and lines are split on \\n only: convert it, "
    "e.g. tr '\\r' '\\n' < IN > OUT"
)


def _cr_only(head: bytes) -> bool:
    """A file's first line, as read (up to the line limit), holds CR but no LF: CR line endings."""
    return b"\r" in head and b"\n" not in head


def _lines(
    path: Path | DataFile, max_line_bytes: int, notes: dict[str, bool] | None = None
) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, raw bytes without newline or None when over the limit, full length). A UTF-8 BOM at
    the file's first byte (decompressed) is not content: dropped before line 1 (line numbers and record ids
    are as without it; a resumed reader reads from the start too, so they agree). `notes["cr"]`: set when
    the first line read has CR but no LF (CR line endings: the file is one line)."""
    with formats.open_binary(path) as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 1 + (len(BOM) if lineno == 0 else 0))
            if lineno == 0 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw:
                return
            if lineno == 0 and notes is not None and _cr_only(raw):
                notes["cr"] = True
            lineno += 1
            if len(raw) - raw.endswith(b"\n") > max_line_bytes:
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # drain the rest of the line without keeping it
                    raw = f.readline(DRAIN_CHUNK)
                    size += len(raw)
                yield lineno, None, size
                continue
            yield lineno, raw.rstrip(b"\r\n"), len(raw)


def _text_records(
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
    for lineno, raw, size in _lines(path, max_line_bytes, notes):
        where = f"{path}:{lineno}"
        if raw is None:
            cr = f"; {CR_HINT}" if notes.get("cr") else ""
            line, problem = (
                None,
                (
                    "line_too_long",
                    where,
                    f"line of {size:,} bytes exceeds --max-line-bytes {max_line_bytes:,}{cr}",
                ),
            )
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
                yield flush()
                rid += 1
                lines, warnings = [], []
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


def _printable_name(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


LABELS_HINT = (
    '"labels" is not read: write {"ids": [...], "loss_mask": [...]} (loss_mask 0 where labels is -100, '
    'else 1) or {"prompt": "...", "completion": "..."}'
)


def _jsonl_records(
    path: Path | DataFile,
    first_rid: int,
    max_line_bytes: int,
    vocab_size: int | None,
    notes: dict[str, bool] | None = None,
    text_key: str = "text",
) -> Iterator[Record]:
    rid = first_rid
    notes = {} if notes is None else notes
    for lineno, raw, size in _lines(path, max_line_bytes, notes):
        where = f"{path}:{lineno}"
        if raw is not None and not raw.strip():
            continue  # blank lines are not records
        rec = Record(rid=rid, where=where)
        rid += 1
        if raw is None:
            cr = f"; {CR_HINT}" if notes.get("cr") else ""
            rec.bad = ("line_too_long", f"line of {size} bytes exceeds {max_line_bytes}{cr}")
            yield rec
            continue
        if lineno == 1 and raw.strip() == b"[":  # a JSON array (what json.dump writes): each line is junk
            rec.bad = ("bad_json", "a JSON array, not JSON Lines: write one object per line (jq -c '.[]')")
            yield rec
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            rec.bad = ("invalid_utf8", f"invalid UTF-8 at byte {exc.start}")
        except json.JSONDecodeError as exc:
            cr = f"; {CR_HINT}" if notes.get("cr") and lineno == 1 else ""
            rec.bad = ("bad_json", f"not valid JSON ({exc.msg} at column {exc.colno}){cr}")
        except RecursionError:  # [[[[... or {"a":{"a":... a few hundred KB deep: the parser's stack, not ours
            rec.bad = ("bad_json", "JSON nested too deeply to parse")
        else:
            if not isinstance(obj, dict):
                kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
                    type(obj), "a number"
                )
                rec.bad = ("bad_json", f"line is {kind}, not a JSON object (JSON Lines: one object per line)")
            elif "prompt" in obj or "completion" in obj:
                _prompt_completion(rec, obj)
            elif "loss_mask" in obj:
                _masked_ids(rec, obj, vocab_size)
            elif isinstance(obj.get(text_key), str):
                rec.text = obj[text_key]
                if not rec.text.strip():
                    rec.bad = ("empty", "empty text")
            elif "labels" in obj:  # Hugging Face's targets: training every id instead would be silent harm
                rec.bad = ("bad_mask", LABELS_HINT)
            elif isinstance(obj.get("ids"), list):
                ids = obj["ids"]
                limit = vocab_size or (1 << 31)
                if not ids:
                    rec.bad = ("empty", "empty ids")
                elif not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in ids):
                    rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
                else:
                    rec.ids = ids
            else:
                strings = [k for k, v in obj.items() if isinstance(v, str)][:4]
                hint = (
                    f"; its string keys: {', '.join(strings)} (--text-column NAME reads one)"
                    if strings
                    else ""
                )
                rec.bad = (
                    "missing_text",
                    f'object has no "{text_key}" string, "ids" list, or "prompt" and "completion" strings{hint}',
                )
            if rec.bad is None and _SURROGATE_ESCAPE.search(raw) and not _utf8(rec.text, rec.prompt):
                rec.bad = (
                    "invalid_utf8",
                    "a lone UTF-16 surrogate escape (\\ud800-\\udfff), which UTF-8 cannot hold",
                )
            if rec.bad is None:
                _say_unread(path, where, obj, text_key)
        yield rec


# JSON may escape half of a UTF-16 pair ("\ud800"); json.loads keeps it as a lone surrogate, which no UTF-8
# text holds and the tokenizer refuses with a TypeError that stopped the producer. Pairs decode to one
# character. Only lines with such an escape are checked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _utf8(*texts: str | None) -> bool:
    try:
        for t in texts:
            if t is not None:
                t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


KNOWN_KEYS = ("text", "ids", "input_ids", "prompt", "completion", "loss_mask")


def _say_unread(path: Path | DataFile, where: str, obj: dict, text_key: str = "text") -> None:
    """Once per file: a good record that also holds the keys of another kind of record, not read."""
    if str(path) in _said_unread:
        return
    used: tuple[str, ...]
    if "prompt" in obj or "completion" in obj:  # the kinds as _jsonl_records tells them apart
        used, rule = ("prompt", "completion"), "a prompt/completion record trains its completion"
    elif "loss_mask" in obj:
        used, rule = ("ids", "loss_mask"), "a record with a loss_mask trains the ids it marks"
    elif isinstance(obj.get(text_key), str):
        used, rule = (text_key,), f'a record with "{text_key}" trains its text'
        if isinstance(obj.get("ids"), list):
            rule += f' (drop "{text_key}" to train "ids" as they are)'
    else:
        used, rule = ("ids",), "an ids record trains its ids as they are"
    unread = [k for k in KNOWN_KEYS if k not in used and obj.get(k) is not None]
    if unread:
        _said_unread.add(str(path))  # once per file and process: files are reopened every epoch
        hint = '; token ids go in "ids" in JSON Lines' if "input_ids" in unread else ""
        log.warning("%s: %s not read: %s%s (said once per file)", where,
                    ", ".join(f'"{k}"' for k in unread), rule, hint)  # fmt: skip


def _prompt_completion(rec: Record, obj: dict) -> None:
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        got = ", ".join(f"{k} is {type(obj.get(k)).__name__ if k in obj else 'missing'}"
                        for k in ("prompt", "completion"))  # fmt: skip
        hint = '; a plain "text" record has neither key' if "text" in obj else ""
        rec.bad = ("bad_prompt", f'"prompt" and "completion" must both be strings ({got}){hint}')
    elif not completion.strip():
        rec.bad = ("empty", "empty completion: nothing to train on")
    else:
        rec.prompt, rec.text = prompt, completion


def _masked_ids(rec: Record, obj: dict, vocab_size: int | None) -> None:
    ids, mask = obj.get("ids"), obj.get("loss_mask")
    limit = vocab_size or (1 << 31)
    if not isinstance(ids, list):
        rec.bad = ("bad_mask", '"loss_mask" needs an "ids" list of the same length')
    elif not ids:
        rec.bad = ("empty", "empty ids")
    elif not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in ids):
        rec.bad = ("bad_ids", f"ids must be integers in [0, {limit})")
    elif not isinstance(mask, list) or len(mask) != len(ids):
        what = f"{len(mask)} values" if isinstance(mask, list) else f"a {type(mask).__name__}"
        rec.bad = ("bad_mask", f"loss_mask must be a list of {len(ids)} values (one per id), not {what}")
    elif not all(type(m) is int and m in (0, 1) for m in mask):  # True/False are not 1/0 here either
        rec.bad = ("bad_mask", "loss_mask values must be 0 or 1")
    else:
        rec.ids, rec.loss_mask = ids, mask


class _FetchedRecord(Record):
    """A record of remote shards whose ids arrive with the others requested before them (one batch of
    concurrent ranged reads) when any of them is first read; the stream reads ids a chunk at a time."""

    def __init__(self, rid: int, pending, where: str):
        self.rid, self.text, self.where, self.bad, self.warnings = rid, None, where, None, None
        self.prompt = None
        self._pending = pending

    @property
    def ids(self) -> np.ndarray:  # type: ignore[override]
        return self._pending.result()

    @property
    def loss_mask(self) -> np.ndarray | None:  # type: ignore[override]
        self._pending.result()
        return self._pending.mask


class Corpus:
    """Records from a list of files (formats.py says which formats, by name or content), or the
    built-in corpus when no files are given."""

    def __init__(
        self,
        paths: list[str] | None = None,
        *,
        doc_split: str = "blank",
        builtin_docs: int = 20_000,
        builtin_seed: int = 0,
        text_column: str = "text",
        max_line_bytes: int = MAX_LINE_BYTES,
        vocab_size: int | None = None,
    ):
        if doc_split not in DOC_SPLITS:
            raise ValueError(f"--doc-split must be one of {', '.join(DOC_SPLITS)}, not {doc_split!r}")
        self.shards: ShardSet | None = None
        local = [local_path(p) for p in paths or []]  # a file:// URL of a folder is that folder
        if paths and len(paths) == 1 and is_shard_dir(local[0] or paths[0]):
            self.shards = ShardSet(local[0] or paths[0])
            self.paths: list[DataFile] = []
        elif shard_set := next(
            (p for p, d in zip(paths or [], local, strict=True) if d is not None and is_shard_dir(d)), None
        ):
            raise ValueError(
                f"--data {shard_set} is a shard set (lmpipe prepare): give it as the only --data"
            )
        else:
            self.paths = formats.resolve(paths or [])
            for f in self.paths:  # binary formats (Parquet, Arrow) are told apart in formats.py
                if f.fmt in ("text", "jsonl") and f.remote is None:
                    refuse_binary(f)
        self.doc_split = doc_split
        self.builtin_docs = builtin_docs
        self.builtin_seed = builtin_seed
        self.max_line_bytes = max_line_bytes
        self.vocab_size = vocab_size
        self.text_column = text_column  # the table column or JSON Lines key holding a document's text
        # what reading the files found, for the notices about a shard's share (stream.py): text files read
        # as one document of several lines, and text/JSONL files with CR line endings
        self.one_document: set[str] = set()
        self.cr_endings: set[str] = set()

    def _say_cr(self, p: DataFile) -> None:
        self.cr_endings.add(str(p))
        if str(p) not in _said_cr:  # once per file and process: files are reopened every epoch
            _said_cr.add(str(p))
            log.warning("%s: %s", p, CR_HINT)

    @classmethod
    def of(cls, cfg: PipelineConfig, vocab_size: int | None = None) -> Corpus:
        """The corpus a pipeline config names (producers, `lmpipe run`'s checks and `prepare` alike)."""
        return cls(
            cfg.data,
            doc_split=cfg.doc_split,
            text_column=cfg.text_column,
            builtin_docs=cfg.builtin_docs,
            builtin_seed=cfg.seed,
            max_line_bytes=cfg.max_line_bytes,
            vocab_size=vocab_size,
        )

    @property
    def builtin(self) -> bool:
        return not self.paths and self.shards is None

    @property
    def random_access(self) -> bool:
        """Any document can be read by index, so a whole epoch can be shuffled, not just a window."""
        return self.shards is not None or self.builtin

    def describe(self) -> str:
        if self.shards is not None:
            m = self.shards.meta
            return f"shards in {self.shards.path} ({m['documents']:,} documents, {m['tokens']:,} tokens)"
        if self.builtin:
            return f"built-in corpus ({self.builtin_docs} documents, seed {self.builtin_seed})"
        return ", ".join(str(p) for p in self.paths)

    def fingerprint(self) -> str:
        """Identifies the data for the handshake and checkpoints: names and sizes, not contents."""
        if self.shards is not None:
            return self.shards.fingerprint()
        if self.builtin:
            return f"builtin:{self.builtin_seed}:{self.builtin_docs}"
        # a local file and its remote copy agree; a name that is not UTF-8 is shown escaped (msgpack)
        parts = [f"{_printable_name(p.name)}:{p.size}" for p in self.paths]
        if self.text_column != "text":
            parts.append(f"column={self.text_column}")
        files = "|".join(parts)
        if len(files) > MAX_FINGERPRINT:  # thousands of files: their digest, so that a hello stays small
            digest = hashlib.sha256(files.encode()).hexdigest()[:16]
            files = f"{len(self.paths)} files of {sum(p.size for p in self.paths):,} bytes, sha256 {digest}"
        return f"{self.doc_split}|{files}"

    def content_digest(self) -> str:
        """A short sha256 over each file's name, size and content digest (formats.DataFile.digest, taken when
        the file was found), in corpus order: what the hello's `data_content` says beside `data` (names and
        sizes), so that the trainer refuses a later producer whose files have the same names and sizes but
        other content. Host-independent (base names, as `data`). "" (not checked) for the built-in corpus
        and shards (their `data` names their content), and when a file has no digest (remote, unreadable):
        a local file and its remote copy agree in `data`, and must not be refused here."""
        if self.shards is not None or self.builtin or any(p.digest is None for p in self.paths):
            return ""
        h = hashlib.sha256()
        for p in self.paths:
            name = _printable_name(p.name).encode()
            h.update(len(name).to_bytes(4, "little") + name + p.size.to_bytes(8, "little"))
            h.update(p.digest or b"")
        return h.hexdigest()[:32]

    def version_digest(self) -> str:
        """For a corpus of remote objects that all report a version (remote.version: an MD5, an ETag),
        "<location>:<digest>": the location a short sha256 of the objects' URLs, the digest one of their URLs,
        sizes and versions, in corpus order. What the hello's `data_versions` says, so that the trainer
        refuses a later producer reading the same objects after one was rewritten (same name, same size),
        without reading them. Only the same objects are compared: a copy in another bucket may carry other
        ETags for the same bytes (a multipart upload), and a local file's content digest is no version.
        "": local files, local and remote mixed, shards, or a store that reports no version."""
        if self.shards is not None or self.builtin or not self.paths:
            return ""
        if not all(p.remote is not None and p.version for p in self.paths):
            return ""
        # each URL as its filesystem spells it (s3a://b/k and a folder's s3://b/k are one object)
        urls = [p.remote.url(p.remote.key(p.path)) for p in self.paths if p.remote is not None]
        where = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]
        h = hashlib.sha256()
        for url, p in zip(urls, self.paths):
            h.update(f"{url}\n{p.size}\n{p.version}\n".encode())
        return f"{where}:{h.hexdigest()[:32]}"

    # -- random access (built-in corpus, shards) -----------------------------------------------------

    def owned(self, worker: int, num_workers: int) -> np.ndarray:
        """Indices of the documents whose record id % num_workers == worker."""
        if self.shards is not None:
            return np.flatnonzero(self.shards.rids % num_workers == worker)
        return np.arange(worker, self.builtin_docs, num_workers)

    def record(self, index: int) -> Record:
        if self.shards is not None:
            rid = int(self.shards.rids[index])
            where = f"{self.shards.path}#{index}"
            if self.shards.remote is not None:
                return _FetchedRecord(rid, self.shards.fetch_later(index), where)
            return Record(rid=rid, ids=self.shards.ids(index), loss_mask=self.shards.mask(index), where=where)
        return Record(
            rid=int(index),
            text=builtin_corpus.document(self.builtin_seed, int(index)),
            where=f"builtin:{index}",
        )

    # -- streaming --------------------------------------------------------------------------------------

    def records(self, worker: int = 0, num_workers: int = 1) -> Iterator[Record]:
        """Records whose id % num_workers == worker, in corpus order."""
        if self.random_access:
            for i in self.owned(worker, num_workers):
                yield self.record(i)
            return
        rid = 0
        # every pass reads the files the run found (size, modification time; an object's version), and all
        # of each: one cut short, grown or rewritten would shift record ids and cursors, or end the epoch
        # early. Local files are checked before and after each is read, objects all together before the
        # pass reads any and after it read all (a HEAD request each)
        formats.check_objects(self.paths)
        for p in self.paths:
            formats.check_unchanged(p, routine=True)
            if p.fmt in formats.TABLES:  # yields only this worker's rows; returns the next file's first id
                rid = yield from formats.table_records(
                    p, rid, worker, num_workers, text_column=self.text_column, vocab_size=self.vocab_size,
                    make=Record,
                )  # fmt: skip
                continue
            notes: dict[str, bool] = {}
            if p.fmt == "jsonl":
                it = _jsonl_records(p, rid, self.max_line_bytes, self.vocab_size, notes, self.text_column)
            else:
                it = _text_records(p, rid, self.doc_split, self.max_line_bytes, notes)
            first_rid, only = rid, None
            for rec in it:
                if notes.get("cr") and str(p) not in self.cr_endings:
                    self._say_cr(p)
                rid = rec.rid + 1
                only = rec if rec.rid == first_rid else None
                if rec.rid % num_workers == worker:
                    yield rec
            # (a table's reader checks before each batch and at its end)
            formats.check_unchanged(p, routine=True)
            if p.fmt == "text" and only is not None and only.bad is None and "\n" in (only.text or ""):
                self.one_document.add(str(p))  # lines, but no document boundary: --doc-split's hint
        formats.check_objects(self.paths)


def refuse_binary(path: DataFile) -> None:
    """Raise ValueError when `path` starts like a binary file (a NUL byte in its first bytes, decompressed:
    a .tar.gz too): no text or JSONL corpus has one, and reading it as text makes thousands of junk
    documents. FormatError for a .gz/.zst that fails to decompress within what is read here."""
    try:
        with formats.open_binary(path) as f:
            head = f.read(BINARY_PROBE_BYTES)
    except formats.FormatError:
        # a .gz/.zst damaged in what this read decompressed (its first MiB: open_binary's buffer), or not
        # compressed as named: refused now, by name (a folder's file too, not only the first one read).
        # Damage further on is found where the producers read it: checking each stream whole here would
        # decompress the corpus once more at every start, in every producer
        raise
    except (OSError, EOFError, ValueError):  # unreadable now: reading it says so, by name
        return
    if _utf16(head):  # Windows editors save "Unicode" text so: every other byte of ASCII text is NUL
        raise ValueError(
            f"{path}: UTF-16 text, not UTF-8; convert it (iconv -f UTF-16 -t UTF-8 IN > OUT) and give that"
        )
    at = head.find(b"\0")
    if path.compression is None and (kind := _misnamed(head, at >= 0)):
        what, rename = kind
        raise ValueError(
            f"{path}: {what} data under a {'JSONL' if path.fmt == 'jsonl' else 'text'} file's name (a file's "
            f"format comes from its name); {rename}"
        )
    if at >= 0:
        raise ValueError(
            f"{path}: binary data (a NUL byte at offset {at}{' once decompressed: an archive?' if path.compression else ''}), "
            "not a text or JSONL corpus; give --data "
            "text, JSONL, Parquet or Arrow files (or .gz/.zst of text/JSONL), or a directory from `lmpipe prepare`"
        )


def _misnamed(head: bytes, has_nul: bool) -> tuple[str, str] | None:
    """(what, what to do) for a compressed file or a table whose name says text: gzip's and zstd's magic
    numbers are not UTF-8, so no text starts with them; "PAR1" and "ARROW1" could, so those also need a NUL."""
    kind = formats.magic(head)
    if kind == "gzip":
        return "gzip", "add .gz to its name (x.txt.gz, x.jsonl.gz)"
    if kind == "zstd":
        return "zstd", "add .zst to its name (x.txt.zst, x.jsonl.zst)"
    if has_nul and kind == "parquet":
        return "Parquet", "name it .parquet"
    if has_nul and kind == "arrow":
        return "Arrow", "name it .arrow"
    return None


def _utf16(head: bytes) -> bool:
    """A UTF-16 byte-order mark, or (without one) NUL in every other byte, as mostly-ASCII UTF-16 has."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return True
    pairs = len(head) // 2
    if pairs < 8:
        return False
    for nul_at in (0, 1):  # big- or little-endian
        if head[nul_at::2][:pairs].count(0) > 0.9 * pairs and head[1 - nul_at :: 2][:pairs].count(0) == 0:
            return True
    return False


def expand_paths(paths: list[str]) -> list[str]:
    """Files as given; a directory stands for its corpus files, sorted (formats.resolve says which)."""
    return [str(f) for f in formats.resolve(paths)]
