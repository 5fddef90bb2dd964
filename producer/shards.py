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
meta.json records the format version, dtype, vocabulary size, tokenizer hash, counts, and a sha256 per file;
also the tokenizer's facts (ids of end-of-text and pad, its file's sha256), so that a run given the same file
need not parse it (shared/tokenizer.py; older shard sets without them work, the file is parsed).
Opening a shard set checks all of it (sizes, offsets, checksums, ids inside the vocabulary) before a
document is served; a mismatch names the file and what is wrong.

A shard directory can also be a URL (s3://bucket/shards, any fsspec URL; see remote.py). Nothing is
downloaded whole: meta.json, index and rids files are read at open (16 bytes a document) and checked as
above, token files by their sizes only (a checksum would read every byte); each document is then one
ranged read, fetched together with the rest of its chunk of the stream (concurrent requests), and its ids
are checked against the vocabulary as they arrive.
"""

from __future__ import annotations

import hashlib
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
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.files import SHARD_META as META
from lmpipe.shared.files import is_url, sha256_file
from lmpipe.shared.tokenizer import FACTS, TokenizerInfo, facts_well_formed

FORMAT_VERSION = 2  # 2: shards may hold mask-k.bin; a set without masks is still written as version 1
REMAKE = "restore it or run `lmpipe prepare` again"  # what a damaged meta.json's message ends with
_FILE_KEYS = ("tokens", "index", "rids")  # every shard's files; "mask" too in a shard with a masked document


class ShardError(ValueError):
    pass


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
        self.remote: _RemoteShards | None = None
        if is_url(str(path)):
            self.path: Path | str = str(path).rstrip("/")
            self.remote = _RemoteShards(self, Remote(self.path), verify_checksums)
            return
        self.path = Path(path)
        meta_file = self.path / META
        try:
            text = meta_file.read_bytes()
        except OSError as exc:
            raise ShardError(f"{meta_file}: unreadable ({exc})") from None
        self.meta, dtype = _load_meta(text, meta_file)
        m = self.meta
        self.tokens: list[np.ndarray] = []  # memmaps, or an empty array for an empty shard
        self.masks: list[np.ndarray | None] = []  # per shard: uint8 memmap, or None (every token trained)
        offsets, rids = [], []
        for k, sh in enumerate(m["shards"]):
            files = {n: self.path / sh["files"][n]["name"] for n in _names(sh)}
            sizes = _sizes(sh, dtype)
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

    def fetch_later(self, i: int) -> _Pending:
        """Document i's ids, fetched (remote shards) with every other pending one when first asked for."""
        assert self.remote is not None
        return self.remote.add(i)

    def fingerprint(self) -> str:
        m = self.meta
        return f"shards:{m['tokenizer_hash']}:{m['documents']}:{m['tokens']}:{m['created']}"


def _names(sh: dict[str, Any]) -> tuple[str, ...]:
    return ("tokens", "index", "rids", "mask") if "mask" in sh["files"] else ("tokens", "index", "rids")


def _sizes(sh: dict[str, Any], dtype: np.dtype) -> dict[str, int]:
    return {
        "tokens": sh["tokens"] * dtype.itemsize,
        "index": (sh["documents"] + 1) * 8,
        "rids": sh["documents"] * 8,
        "mask": sh["tokens"],
    }


def _load_meta(text: str | bytes, meta_file: Path | str) -> tuple[dict[str, Any], np.dtype]:
    """meta.json parsed and checked, and its token dtype; anything else is one ShardError naming the file."""
    try:
        m = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON (truncated, hand-edited), not UTF-8, too deep
        raise ShardError(f"{meta_file}: unreadable ({exc}); {REMAKE}") from None
    return m, _check_meta(m, meta_file)


def _json_kind(v: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(v), "a number")


def _shown(m: dict[str, Any], key: str) -> str:
    """A field's value for a message: "missing", or its JSON kind and a short repr."""
    if key not in m:
        return "missing"
    text = repr(m[key])
    return text if len(text) <= 40 else f"{_json_kind(m[key])} ({text[:30]}...)"


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0  # type(): no bools


def _check_meta(m: Any, meta_file: Path | str) -> np.dtype:
    """Every field the readers use has its type and a possible value, before any is used: a hand-edited
    meta.json is a ShardError naming the file and the field, never a KeyError or TypeError later."""

    def bad(what: str) -> ShardError:
        return ShardError(f"{meta_file}: {what}; {REMAKE}")

    if not isinstance(m, dict):
        raise bad(f"{_json_kind(m)}, not a JSON object")
    version = m.get("format_version")
    if type(version) is not int or version < 1:
        raise bad(f"format_version is {_shown(m, 'format_version')}, not a version number")
    if version > FORMAT_VERSION:
        raise ShardError(f"{meta_file}: format_version {version!r}; this lmpipe reads up to {FORMAT_VERSION}")
    if m.get("dtype") not in ("uint16", "int32"):
        raise bad(f"dtype is {_shown(m, 'dtype')}, not uint16 or int32")
    for key in ("vocab_size", "documents", "tokens"):
        if not _count(m.get(key)):
            raise bad(f"{key} is {_shown(m, key)}, not a count")
    if m["vocab_size"] == 0:
        raise bad("vocab_size is 0")
    for key in ("tokenizer_hash", "created"):
        if not isinstance(m.get(key), str):
            raise bad(f"{key} is {_shown(m, key)}, not a string")
    rec = m.get("tokenizer")  # optional: shard sets before these facts were recorded lack it
    if rec is not None:
        if not facts_well_formed(rec):
            raise bad(f"tokenizer is {_shown(m, 'tokenizer')}, not the tokenizer's {'/'.join(FACTS)}")
        if (rec["hash"], rec["vocab_size"]) != (m["tokenizer_hash"], m["vocab_size"]):
            raise bad("tokenizer disagrees with tokenizer_hash or vocab_size")
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise bad(f"shards is {_shown(m, 'shards')}, not a list of shards")
    if not shards:
        raise bad("shards is empty")
    for k, sh in enumerate(shards):
        if not isinstance(sh, dict):
            raise bad(f"shards[{k}] is {_json_kind(sh)}, not an object")
        for key in ("documents", "tokens"):
            if not _count(sh.get(key)):
                raise bad(f"shards[{k}].{key} is {_shown(sh, key)}, not a count")
        files = sh.get("files")
        if not isinstance(files, dict) or not set(_FILE_KEYS) <= files.keys():
            raise bad(f"shards[{k}].files does not name its {'/'.join(_FILE_KEYS)} files")
        for n, f in files.items():
            name = f.get("name") if isinstance(f, dict) else None
            # a plain name in this directory: a hand-edited path must not reach files elsewhere
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
                raise bad(f"shards[{k}].files.{n}.name is {name!r}, not a file name in this directory")
            if not isinstance(f.get("sha256"), str):
                raise bad(f"shards[{k}].files.{n}.sha256 is {f.get('sha256')!r}, not a checksum")
    for key in ("documents", "tokens"):
        total = sum(sh[key] for sh in shards)
        if total != m[key]:
            raise bad(f"{key} is {m[key]}, but its shards hold {total}")
    return np.dtype(m["dtype"]).newbyteorder("<")


class _Pending:
    def __init__(self, owner: _RemoteShards):
        self.owner = owner
        self.ids: np.ndarray | None = None
        self.mask: np.ndarray | None = None  # set with ids when the document's shard has a loss mask

    def result(self) -> np.ndarray:
        if self.ids is None:
            self.owner.flush()
        assert self.ids is not None
        return self.ids


class _RemoteShards:
    """The remote half of a ShardSet: opens and checks it, then fetches documents in batches."""

    MAX_PENDING = 4096  # documents requested but not fetched yet: fetched early beyond this
    # Reading the bytes between two documents beats another request while gap < bandwidth x latency /
    # concurrency (S3: ~100 MB/s x 30 ms / 128 requests in flight ~ 23 KB); the waste is at most
    # MERGE_GAP per document, 8 MiB for a chunk of 512.
    MERGE_GAP = 16 << 10
    MAX_READ = 16 << 20

    def __init__(self, shards: ShardSet, remote: Remote, verify_checksums: bool):
        self.shards, self.r = shards, remote
        base = str(shards.path)
        meta_url = f"{base}/{META}"
        shards.meta, self.dtype = _load_meta(remote.read_all(meta_url), meta_url)
        m = shards.meta
        self.vocab_size = int(m["vocab_size"])
        sizes = {u.rsplit("/", 1)[-1]: size for u, size, _, _ in remote.ls(base)}
        self.token_urls: list[str] = []
        self.mask_urls: list[str | None] = []
        offsets, rids = [], []
        for k, sh in enumerate(m["shards"]):
            expected = _sizes(sh, self.dtype)
            arrays = {}
            self.mask_urls.append(None)
            for n in _names(sh):
                name = sh["files"][n]["name"]
                url = f"{base}/{name}"
                if name not in sizes:
                    raise ShardError(f"{url}: missing")
                if sizes[name] != expected[n]:
                    raise ShardError(
                        f"{url}: {sizes[name]} bytes, meta.json says {expected[n]} (truncated or corrupt)"
                    )
                if n == "tokens":
                    self.token_urls.append(url)
                    continue
                if n == "mask":  # read with the tokens, and checked as they arrive
                    self.mask_urls[k] = url
                    continue
                data = remote.read_all(url) if expected[n] else b""
                if verify_checksums and hashlib.sha256(data).hexdigest() != sh["files"][n]["sha256"]:
                    raise ShardError(f"{url}: checksum mismatch (corrupt file)")
                arrays[n] = np.frombuffer(data, dtype="<i8")
            index = arrays["index"]
            if index[0] != 0 or index[-1] != sh["tokens"] or (np.diff(index) < 0).any():
                raise ShardError(f"{base}/{sh['files']['index']['name']}: offsets are not a valid index")
            offsets.append(np.stack([np.full(sh["documents"], k), index[:-1], index[1:]], axis=1))
            rids.append(arrays["rids"])
        shards.tokens = []
        shards.docs = np.concatenate(offsets) if offsets else np.zeros((0, 3), np.int64)
        shards.rids = np.concatenate(rids) if rids else np.zeros(0, np.int64)
        self.pending: list[tuple[int, _Pending]] = []

    def add(self, i: int) -> _Pending:
        p = _Pending(self)
        self.pending.append((i, p))
        if len(self.pending) >= self.MAX_PENDING:
            self.flush()
        return p

    def flush(self) -> None:
        """Fetch every pending document: per shard file, one batch of concurrent ranged reads, documents
        closer than MERGE_GAP bytes sharing a read (a small shard set comes in a few requests)."""
        pending, self.pending = self.pending, []
        by_shard: dict[int, list[tuple[int, _Pending]]] = {}
        for i, p in pending:
            by_shard.setdefault(int(self.shards.docs[i][0]), []).append((i, p))
        isz = self.dtype.itemsize
        for k, items in by_shard.items():
            url = self.token_urls[k]
            spans = [(int(self.shards.docs[i][1]) * isz, int(self.shards.docs[i][2]) * isz) for i, _ in items]
            blocks: list[list] = []  # [start, end, indices into items]
            for j in sorted((j for j, (a, b) in enumerate(spans) if b > a), key=lambda j: spans[j][0]):
                a, b = spans[j]
                if blocks and a - blocks[-1][1] <= self.MERGE_GAP and b - blocks[-1][0] <= self.MAX_READ:
                    blocks[-1][1] = max(blocks[-1][1], b)
                    blocks[-1][2].append(j)
                else:
                    blocks.append([a, b, [j]])
            got: dict[int, bytes] = {}
            for (start, _, js), data in zip(blocks, self.r.read_many(url, [(s, e) for s, e, _ in blocks])):
                for j in js:
                    got[j] = data[spans[j][0] - start : spans[j][1] - start]
            for j, (i, p) in enumerate(items):
                ids = np.frombuffer(got.get(j, b""), dtype=self.dtype)  # an empty document needs no read
                if len(ids) * isz != spans[j][1] - spans[j][0]:
                    raise ShardError(
                        f"{url}: document {i} came back {len(ids) * isz} bytes, not {spans[j][1] - spans[j][0]}"
                    )
                if ids.size and int(ids.max()) >= self.vocab_size:
                    raise ShardError(
                        f"{url}: document {i} has a token id outside the vocabulary of {self.vocab_size}"
                    )
                p.ids = ids
            mask_url = self.mask_urls[k]
            if mask_url is not None:  # the same reads over the uint8 mask file
                mblocks = [(s // isz, e // isz) for s, e, _ in blocks]
                mgot: dict[int, bytes] = {}
                for (start, _end), (_, _, js), data in zip(
                    mblocks, blocks, self.r.read_many(mask_url, mblocks)
                ):
                    for j in js:
                        mgot[j] = data[spans[j][0] // isz - start : spans[j][1] // isz - start]
                for j, (i, p) in enumerate(items):
                    mask = np.frombuffer(mgot.get(j, b""), dtype=np.uint8)
                    if len(mask) != (spans[j][1] - spans[j][0]) // isz or (mask.size and int(mask.max()) > 1):
                        raise ShardError(f"{mask_url}: document {i}'s loss mask is short or not 0/1")
                    p.mask = mask
