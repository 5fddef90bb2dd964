"""A shard set's meta.json: what it must hold, checked field by field before any is used.

meta.json records the format version, dtype, vocabulary size, tokenizer hash, counts, and a sha256 per file;
also the tokenizer's facts (ids of end-of-text and pad, its file's sha256), so that a run given the same file
need not parse it (shared/tokenizer.py; older shard sets without them work, the file is parsed). A
hand-edited or damaged one is a ShardError naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lmpipe.shared.tokenizer import FACTS, facts_well_formed

FORMAT_VERSION = 2  # 2: shards may hold mask-k.bin; a set without masks is still written as version 1
REMAKE = "restore it or run `lmpipe prepare` again"  # what a damaged meta.json's message ends with
_FILE_KEYS = ("tokens", "index", "rids")  # every shard's files; "mask" too in a shard with a masked document


class ShardError(ValueError):
    pass


def file_names(sh: dict[str, Any]) -> tuple[str, ...]:
    return ("tokens", "index", "rids", "mask") if "mask" in sh["files"] else ("tokens", "index", "rids")


def file_sizes(sh: dict[str, Any], dtype: np.dtype) -> dict[str, int]:
    return {
        "tokens": sh["tokens"] * dtype.itemsize,
        "index": (sh["documents"] + 1) * 8,
        "rids": sh["documents"] * 8,
        "mask": sh["tokens"],
    }


def load_meta(text: str | bytes, meta_file: Path | str) -> tuple[dict[str, Any], np.dtype]:
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
