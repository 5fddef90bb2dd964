"""Pre-tokenized shards: `lmpipe prepare` writes them once, producers memory-map them and skip tokenizing.

A shard directory holds `meta.json` and, per shard k,
  tokens-k.bin  every document's token ids back to back (uint16 or int32, little-endian, no end-of-text:
                the stream appends it, as it does for text)
  index-k.bin   int64 offsets, documents + 1 of them: document i is tokens[index[i]:index[i+1]]
  rids-k.bin    int64 record id of each document in the source corpus (ids of text and shards agree)
  mask-k.bin    only in shards holding a document with a loss mask (prompt/completion or ids + loss_mask
                records): uint8 0/1 per token, laid out as tokens-k.bin; a shard without it trains every
                token. Such a set is format version 2, so an older reader refuses it instead of training on
                the prompts.
meta.json says what the set holds (shard_meta.py).
Opening a shard set checks all of it (sizes, offsets, checksums, ids inside the vocabulary) before a
document is served; a mismatch names the file and what is wrong.

A shard directory can also be a URL (s3://bucket/shards, any fsspec URL): see remote_shards.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmpipe.producer.remote import Remote
from lmpipe.producer.remote_shards import Pending, RemoteShards
from lmpipe.producer.shard_meta import FORMAT_VERSION, ShardError, file_names, file_sizes, load_meta
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.files import SHARD_META as META
from lmpipe.shared.files import is_url, sha256_file
from lmpipe.shared.tokenizer import TokenizerInfo

__all__ = ["FORMAT_VERSION", "RemoteShards", "ShardError", "ShardSet", "check_out", "is_shard_dir", "prepare"]
_RemoteShards = RemoteShards  # its name in bench/sources.py


def is_shard_dir(path: str | Path) -> bool:
    if is_url(str(path)):
        url = str(path).rstrip("/")
        r = Remote(url)
        try:
            return r.info(url)["type"] == "directory" and r.info(f"{url}/{META}")["type"] == "file"
        except FileNotFoundError:
            return False  # resolving the path as files will say what is missing
    return (Path(path) / META).is_file() and any(_SHARD_FILE.fullmatch(p.name) for p in Path(path).iterdir())


_SHARD_FILE = re.compile(r"(tokens|index|rids|mask)-\d+\.bin")  # what prepare writes beside META


def written_by_prepare(path: Path) -> bool:
    """Only what prepare writes (META and shard files) is in `path`, and META is lmpipe's: the one kind of
    folder --force may replace (a dataset's own meta.json beside its files is not)."""
    names = [p.name for p in path.iterdir()]
    if META not in names or not all(n == META or _SHARD_FILE.fullmatch(n) for n in names):
        return False
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format_version" in meta


class _ShardWriter:
    def __init__(self, out: Path, k: int, dtype: np.dtype):
        self.out, self.k = out, k
        self.names = {n: f"{n}-{k:05d}.bin" for n in ("tokens", "index", "rids")}
        self.files = {n: open(out / name, "wb") for n, name in self.names.items()}  # noqa: SIM115 - closed in close()
        self.dtype = dtype
        self.tokens = 0
        self.docs = 0
        self.files["index"].write(np.zeros(1, dtype="<i8").tobytes())

    def add(self, rid: int, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        if mask is not None and "mask" not in self.files:  # the first masked document: earlier ones train all
            self.names["mask"] = f"mask-{self.k:05d}.bin"
            self.files["mask"] = open(self.out / self.names["mask"], "wb")  # noqa: SIM115 - closed in close()
            for a in range(0, self.tokens, 1 << 20):
                self.files["mask"].write(np.ones(min(1 << 20, self.tokens - a), dtype=np.uint8).tobytes())
        if "mask" in self.files:
            m = np.ones(len(ids), dtype=np.uint8) if mask is None else mask.astype(np.uint8)
            self.files["mask"].write(m.tobytes())
        self.files["tokens"].write(ids.astype(self.dtype).tobytes())
        self.tokens += len(ids)
        self.docs += 1
        self.files["index"].write(np.array([self.tokens], dtype="<i8").tobytes())
        self.files["rids"].write(np.array([rid], dtype="<i8").tobytes())

    def close(self, out: Path) -> dict[str, Any]:
        for f in self.files.values():
            f.close()
        return {
            "documents": self.docs,
            "tokens": self.tokens,
            "files": {n: {"name": name, "sha256": sha256_file(out / name)} for n, name in self.names.items()},
        }


def check_out(out: Path, force: bool, inputs: Sequence[str] = ()) -> None:
    """`out` may be replaced only when it is a shard set (or an empty directory) and holds no input: --force
    must never delete a corpus or a directory that prepare did not write."""
    if out.is_symlink():  # found only after the work, by rmtree, and the finished copy was left behind
        raise ShardError(f"--out {out} is a symbolic link; name the folder itself")
    where = out.resolve()
    for given in inputs:
        p = Path(given).resolve()
        if p == where or where in p.parents:
            raise ShardError(
                f"--out {out} holds the corpus {given}: preparing would replace it; choose another --out"
            )
    if out.exists() and not out.is_dir():
        raise ShardError(f"{out} exists and is not a directory; choose another --out")
    if out.exists():
        if not force:
            raise ShardError(f"{out} already exists; pass --force to replace it")
        if any(out.iterdir()) and not written_by_prepare(out):
            raise ShardError(
                f"{out} is not a shard set (other files than prepare writes, or no {META} of lmpipe's); "
                "--force replaces only those: choose another --out"
            )


def prepare(stream, out: str | Path, *, shard_tokens: int = 1 << 26, source: str = "", force: bool = False,
            progress: bool = True, inputs: Sequence[str] = ()) -> dict[str, Any]:  # fmt: skip
    """Tokenize every document of `stream` (a DocStream over the whole corpus, one worker, no shuffle)
    into shards under `out`. Written to a temporary directory beside it and renamed, so `out` is whole or
    absent. `inputs`: the corpus's local paths, which `out` must not hold."""
    out = Path(out)
    check_out(out, force, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # unique: never a user's folder
    try:  # from here on: a stop (Ctrl-C, SIGTERM as the CLI takes it) removes it
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would keep a team's shard set from everyone else
        meta = _write_shards(stream, tmp, shard_tokens, source, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def _write_shards(stream, tmp: Path, shard_tokens: int, source: str, progress: bool) -> dict[str, Any]:
    tok = stream.tok
    dtype = token_dtype(tok.vocab_size)
    shards: list[dict[str, Any]] = []
    writer = _ShardWriter(tmp, 0, dtype)
    docs = tokens = 0
    t0 = last = time.monotonic()
    tty = progress and sys.stderr.isatty()
    for doc in stream.docs(0):
        ids = doc.ids[:-1]  # drop the end-of-text token; the reader adds it back (and its mask)
        writer.add(doc.doc_id, ids, None if doc.mask is None else doc.mask[:-1])
        docs += 1
        tokens += len(ids)
        if writer.tokens >= shard_tokens:
            shards.append(writer.close(tmp))
            writer = _ShardWriter(tmp, len(shards), dtype)
        now = time.monotonic()
        if progress and (now - last > (0.5 if tty else 10)):
            rate = tokens / (now - t0)
            msg = f"prepared {docs:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)"
            sys.stderr.write(("\r" + msg) if tty else (msg + "\n"))
            sys.stderr.flush()
            last = now
    shards.append(writer.close(tmp))
    masked = any("mask" in sh["files"] for sh in shards)
    meta = {
        "format_version": FORMAT_VERSION if masked else 1,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer_hash": tok.hash,
        "tokenizer": tok.facts(),  # so that a run from these shards need not parse the tokenizer
        "documents": docs,
        "tokens": tokens,
        "source": source,
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / META).write_text(json.dumps(meta, indent=1))
    if progress:
        dt = time.monotonic() - t0
        sys.stderr.write(
            f"{chr(13) if tty else ''}prepared {docs:,} documents, {tokens:,} tokens in {dt:.1f} s\n"
        )
    return meta


def check_prepared_with(shards: ShardSet, tok: TokenizerInfo) -> None:
    """Shards are read with the tokenizer that made them: another one's ids would mean other tokens."""
    made_by = shards.meta["tokenizer_hash"]
    if made_by != tok.hash:
        raise ShardError(
            f"{shards.path} was prepared with tokenizer {made_by}, this run uses {tok.hash} ({tok.path}); "
            "pass the same --tokenizer or prepare again"
        )


class ShardSet:
    """Read-only, memory-mapped view of a prepared shard directory, checked on open."""

    def __init__(self, path: str | Path, *, verify_checksums: bool = True):
        self.remote: RemoteShards | None = None
        if is_url(str(path)):
            self.path: Path | str = str(path).rstrip("/")
            self.remote = RemoteShards(self, Remote(self.path), verify_checksums)
            return
        self.path = Path(path)
        meta_file = self.path / META
        try:
            text = meta_file.read_bytes()
        except OSError as exc:
            raise ShardError(f"{meta_file}: unreadable ({exc})") from None
        self.meta, dtype = load_meta(text, meta_file)
        m = self.meta
        self.tokens: list[np.ndarray] = []  # memmaps, or an empty array for an empty shard
        self.masks: list[np.ndarray | None] = []  # per shard: uint8 memmap, or None (every token trained)
        offsets, rids = [], []
        for k, sh in enumerate(m["shards"]):
            files = {n: self.path / sh["files"][n]["name"] for n in file_names(sh)}
            sizes = file_sizes(sh, dtype)
            for n, f in files.items():
                if not f.is_file():
                    raise ShardError(f"{f}: missing")
                if f.stat().st_size != sizes[n]:
                    raise ShardError(
                        f"{f}: {f.stat().st_size} bytes, meta.json says {sizes[n]} (truncated or corrupt)"
                    )
                if verify_checksums and sha256_file(f) != sh["files"][n]["sha256"]:
                    raise ShardError(f"{f}: checksum mismatch (corrupt file)")
            toks = np.memmap(files["tokens"], dtype=dtype, mode="r") if sh["tokens"] else np.zeros(0, dtype)
            index = np.fromfile(files["index"], dtype="<i8")
            if index[0] != 0 or index[-1] != sh["tokens"] or (np.diff(index) < 0).any():
                raise ShardError(
                    f"{files['index']}: offsets are not a valid index into {files['tokens'].name}"
                )
            if toks.size and int(toks.max()) >= m["vocab_size"]:
                raise ShardError(f"{files['tokens']}: token id outside the vocabulary of {m['vocab_size']}")
            self.tokens.append(toks)
            mask = None
            if "mask" in files:
                mask = (
                    np.memmap(files["mask"], dtype=np.uint8, mode="r")
                    if sh["tokens"]
                    else np.zeros(0, np.uint8)
                )
                if mask.size and int(mask.max()) > 1:
                    raise ShardError(f"{files['mask']}: loss mask values must be 0 or 1")
            self.masks.append(mask)
            offsets.append(np.stack([np.full(sh["documents"], k), index[:-1], index[1:]], axis=1))
            rids.append(np.fromfile(files["rids"], dtype="<i8"))
        # one row per document: (shard, start, end); plus its record id
        self.docs = np.concatenate(offsets) if offsets else np.zeros((0, 3), np.int64)
        self.rids = np.concatenate(rids) if rids else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.rids)

    def ids(self, i: int) -> np.ndarray:
        if self.remote is not None:
            return self.fetch_later(i).result()
        k, a, b = self.docs[i]
        return self.tokens[k][a:b]

    def mask(self, i: int) -> np.ndarray | None:
        """Document i's loss mask (0/1 per token of ids(i)), or None when its shard trains every token."""
        if self.remote is not None:
            pending = self.fetch_later(i)
            pending.result()
            return pending.mask
        k, a, b = self.docs[i]
        mask = self.masks[k]
        return None if mask is None else mask[a:b]

    def fetch_later(self, i: int) -> Pending:
        """Document i's ids, fetched (remote shards) with every other pending one when first asked for."""
        assert self.remote is not None
        return self.remote.add(i)

    def fingerprint(self) -> str:
        m = self.meta
        return f"shards:{m['tokenizer_hash']}:{m['documents']}:{m['tokens']}:{m['created']}"
