"""The corpus: a list of files, a shard set or the built-in corpus, as one stream of numbered records.

Every record gets an id: its index across all files in the order given. Good records are documents;
bad ones (invalid UTF-8, broken JSON, empty, over-long lines) are reported with file and line, counted by
reason, and skipped. Each record is reported by exactly one worker, the one that owns its id, so N
producers reading the same files do not report a bad line N times.

A directory written by `lmpipe prepare` (it holds meta.json) is read as pre-tokenized shards (shards.py).
Files: text, JSONL (compressed too), Parquet, Arrow and Hugging Face `save_to_disk` folders, each read by
its reader in formats/; any of them, and shards, can be a URL (s3://bucket/prefix, any fsspec URL): see
remote.py.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator

import numpy as np

from lmpipe.producer import builtin_corpus, formats
from lmpipe.producer.formats import CR_HINT, DOC_SPLITS, DataFile, refuse_binary
from lmpipe.producer.records import BadRecords, Record
from lmpipe.producer.shards import ShardSet, is_shard_dir
from lmpipe.shared.config import MAX_LINE_BYTES, PipelineConfig
from lmpipe.shared.files import local_path
from lmpipe.shared.messages import version_location

__all__ = ["CR_HINT", "BadRecords", "Corpus", "Record", "expand_paths"]  # what the others import from here

log = logging.getLogger("lmpipe.producer")
# The corpus's files in its fingerprint, at most (characters), which travels in every hello (16 KiB, with
# the skipped counts): beyond it, their digest. 1,024 files named like C4's took 36 KB and were refused.
MAX_FINGERPRINT = 8192
_said_cr: set[str] = set()  # files with CR line endings, said once
# A checkpoint's per-object versions (its `data_objects`: Corpus.object_versions), so that a resume refused
# after an object was rewritten names it: OBJECT_DIGEST hex digits of each object's URL, size and version,
# for corpora of at most MAX_NAMED_OBJECTS objects (32 KiB of header). A larger corpus keeps only its
# location's digest (`data_versions`), and its refusal names no object, as before.
OBJECT_DIGEST = 8
MAX_NAMED_OBJECTS = 4096


def _printable_name(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


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
    """Records from a list of files (formats/ says which formats, by name or content), or the
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
            for f in self.paths:  # binary formats (Parquet, Arrow) are told apart in formats/
                if f.fmt in ("text", "jsonl") and f.remote is None:
                    refuse_binary(f)
                elif f.fmt in formats.TABLES and f.remote is None:
                    formats.check_table(f, text_column)
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

    def fingerprint(self, limit: int = MAX_FINGERPRINT) -> str:
        """Identifies the data for the handshake and checkpoints: names and sizes, not contents; the files
        beyond `limit` characters as their digest (a mixture's sources share MAX_FINGERPRINT)."""
        if self.shards is not None:
            return self.shards.fingerprint()
        if self.builtin:
            return f"builtin:{self.builtin_seed}:{self.builtin_docs}"
        # a local file and its remote copy agree; a name that is not UTF-8 is shown escaped (msgpack)
        parts = [f"{_printable_name(p.name)}:{p.size}" for p in self.paths]
        if self.text_column != "text":
            parts.append(f"column={self.text_column}")
        files = "|".join(parts)
        if len(files) > limit:  # thousands of files: their digest, so that a hello stays small
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
        urls = self._object_urls()
        if not urls:
            return ""
        where = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16]
        h = hashlib.sha256()
        for url, p in zip(urls, self.paths, strict=True):
            h.update(f"{url}\n{p.size}\n{p.version}\n".encode())
        return f"{where}:{h.hexdigest()[:32]}"

    def _object_urls(self) -> list[str]:
        """Each file's URL as its filesystem spells it (s3a://b/k and a folder's s3://b/k are one object),
        where every file is a remote object whose store reports a version; [] otherwise."""
        if self.shards is not None or self.builtin or not self.paths:
            return []
        if not all(p.remote is not None and p.version for p in self.paths):
            return []
        return [p.remote.url(p.remote.key(p.path)) for p in self.paths if p.remote is not None]

    def _object_digests(self, urls: list[str]) -> list[str]:
        return [
            hashlib.sha256(f"{url}\n{p.size}\n{p.version}".encode()).hexdigest()[:OBJECT_DIGEST]
            for url, p in zip(urls, self.paths, strict=True)
        ]

    def object_versions(self) -> dict[str, str]:
        """{location: each object's short digest (of its URL, size and version), in corpus order, as one
        string}: what a checkpoint keeps beside `data_versions` (the location's one digest), so that a resume
        refused after an object was rewritten can name it (rewritten()). {} where version_digest is "", or
        for more than MAX_NAMED_OBJECTS objects."""
        urls = self._object_urls()
        if not urls or len(urls) > MAX_NAMED_OBJECTS:
            return {}
        return {version_location(self.version_digest()): "".join(self._object_digests(urls))}

    def rewritten(self, had: object) -> list[str]:
        """The URLs of the objects whose version differs from `had` (object_versions' string for these
        objects' location, as a checkpoint kept it), in corpus order; [] where `had` is no such string."""
        urls = self._object_urls()
        if not isinstance(had, str) or len(had) != OBJECT_DIGEST * len(urls) or not urls:
            return []
        old = [had[i : i + OBJECT_DIGEST] for i in range(0, len(had), OBJECT_DIGEST)]
        return [u for u, a, b in zip(urls, old, self._object_digests(urls), strict=True) if a != b]

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
                it = formats.jsonl_records(
                    p, rid, self.max_line_bytes, self.vocab_size, notes, self.text_column
                )
            else:
                it = formats.text_records(p, rid, self.doc_split, self.max_line_bytes, notes)
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


def expand_paths(paths: list[str]) -> list[str]:
    """Files as given; a directory stands for its corpus files, sorted (formats.resolve says which)."""
    return [str(f) for f in formats.resolve(paths)]
