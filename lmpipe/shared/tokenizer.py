"""Tokenizer loading, hashing and training (Hugging Face `tokenizers`).

The built-in tokenizer is a byte-level BPE trained by `lmpipe tokenizer train --builtin` on the built-in
corpus and shipped as `shared/assets/builtin-tokenizer.json`, so the default run downloads nothing. Any
Hugging Face `tokenizer.json` works through `--tokenizer FILE`. Producers and trainer compare the hash of
the tokenizer's canonical serialization during the handshake.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmpipe.shared.files import SHARD_META, local_path

BUILTIN_PATH = Path(__file__).parent / "assets" / "builtin-tokenizer.json"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")

# Bounded tokenization. One encode call holds every Encoding of its texts at once, with the tokenizer's
# bookkeeping: ~160 bytes per character. A 60 MB single-document file (WikiText-2 lines, built-in tokenizer,
# 2-core box) took 10.0 GB and 39 s in one call; in pieces 0.49 GB (the text and its ids, mostly), 10-16 s,
# with the same 35.5 M ids. A text longer than PIECE_CHARS is encoded in pieces, and a call gets at most
# CALL_CHARS characters in all (pieces of one text, or many texts): ~100 MB of Encodings, ~0.15 s. On 8 MiB
# of WikiText there, 1 MiB calls ran as fast as any size tried (pieces of 16 KiB 9 Mchar/s, 64 KiB 7,
# 1 MiB 3.3; all 8 MiB in one call 2.3) and 4 MiB calls held twice the memory for nothing.
PIECE_CHARS = 64 * 1024  # above most documents, so those are encoded whole as before
CALL_CHARS = 1024 * 1024
CUT_SEARCH = 4096  # how far before a piece's longest end a cut at whitespace is looked for
CUT_TRIES = 16  # candidate cuts checked (of each kind) before falling back to any whitespace
CUT_CONTEXT = 64  # characters either side of a candidate cut that the check encodes
# Where a piece ends (see TokenizerInfo._cut): just before a space, else any whitespace character, that
# follows a non-space one. Python's \s (str.isspace) holds every character the tokenizers' regexes call
# whitespace; a space first, since a tokenizer that adds one at a text's start (ByteLevel's
# add_prefix_space, Metaspace) adds none to a piece that starts with one.
_CUT_BEFORE = (re.compile(r"(?<=\S) "), re.compile(r"(?<=\S)\s"))
_WHITESPACE = re.compile(r"\s")
_inexact: set[str] = set()  # tokenizer files for which no cut kept the ids: not checked again
_said_inexact: set[str] = set()  # tokenizer files whose cut pieces were said to differ, once per process

log = logging.getLogger("lmpipe")


# What a run needs to know of a tokenizer, besides the tokenizer itself. `lmpipe prepare` records them in a
# shard directory's meta.json with the file's sha256, so that a run from shards, which never tokenizes, need
# not parse the file (a 32k BPE takes ~40 ms, most of a shard run's time to its first batch).
FACTS = {"file_sha256": str, "hash": str, "vocab_size": int, "eos_id": int, "pad_id": int}


def facts_well_formed(rec: Any) -> bool:
    """A mapping holding every fact, each of its type (type(): a bool is not an id)."""
    return isinstance(rec, dict) and all(type(rec.get(k)) is t for k, t in FACTS.items())


@dataclass
class TokenizerInfo:
    path: str
    hash: str  # of the canonical serialization: the same tokenizer saved differently hashes the same
    vocab_size: int
    eos_id: int
    pad_id: int
    file_sha256: str  # of the file's bytes: cheap to check against what meta.json recorded
    # the file version (resolved path, mtime, size): what `tokenizer` parses
    _key: tuple[str, int, int] = field(repr=False, compare=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """The parsed tokenizer, parsed on first use (a run from shards never uses it)."""
        try:
            return _parse(*self._key)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}") from None

    def facts(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FACTS}

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added. encode_batch_fast (tokenizers >= 0.21) skips
        the character offsets nobody here reads: about 12% less time on WikiText-2; the ids are the same."""
        return [e.ids for e in self._encoder()(texts, add_special_tokens=False)]

    def _encoder(self) -> Callable:
        """encode_batch_fast (tokenizers >= 0.21), else encode_batch."""
        tok = self.tokenizer
        return getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode_arrays(
        self, texts: Sequence[str], keepalive: Callable[[], None] | None = None
    ) -> list[np.ndarray]:
        """encode_ids' ids, in bounded memory: a text longer than PIECE_CHARS is encoded in pieces (cut where
        _cut says) and each encode call gets at most CALL_CHARS characters. One uint32 array per text (the
        tokenizer's own id type: half of int64's memory while a long text's pieces are joined). `keepalive`
        is called after every call, so a caller that must be heard from (a producer's heartbeat) is, however
        long the document."""
        encode = self._encoder()
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        call: list[tuple[int, str]] = []
        size = 0
        for i, piece in self._pieces(texts):
            if call and size + len(piece) > CALL_CHARS:
                self._encode_call(encode, call, parts, keepalive)
                call, size = [], 0
            call.append((i, piece))
            size += len(piece)
        if call:
            self._encode_call(encode, call, parts, keepalive)
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]

    @staticmethod
    def _encode_call(
        encode: Callable,
        call: list[tuple[int, str]],
        parts: list[list[np.ndarray]],
        keepalive: Callable[[], None] | None,
    ) -> None:
        for (i, _), e in zip(call, encode([t for _, t in call], add_special_tokens=False)):
            parts[i].append(np.array(e.ids, dtype=np.uint32))
        if keepalive is not None:
            keepalive()

    def _pieces(self, texts: Sequence[str]) -> Iterator[tuple[int, str]]:
        """(text index, piece) in order; a text of at most PIECE_CHARS is its own only piece."""
        for i, text in enumerate(texts):
            start = 0
            while True:
                end = self._cut(text, start)
                yield i, text[start:end]
                if end == len(text):
                    break
                start = end

    def _cut(self, text: str, start: int) -> int:
        """Where the piece of `text` from `start` ends, at most PIECE_CHARS on.

        Exactness: a cut is taken where the tokenizer itself gives the same ids to the text around it whole
        and in two pieces (_exact_at), before a space first, then before any whitespace, that follows a
        non-space character. So the pieces' ids are the whole text's wherever the tokenizer never merges
        across such a cut: pre-tokenizers that split at whitespace (GPT-2's regex, the built-in tokenizer:
        always exact), whatever a normalizer or added token does at the cut caught by the check. Where no
        candidate in the last CUT_SEARCH characters passes (a tokenizer that prepends '▁' to every text, no
        pre-tokenizer, text without spaces), the cut is before the last whitespace there, else a hard cut
        (minified, binary-ish text): memory stays bounded, the tokens at that cut may differ, and the first
        such cut is said once per tokenizer."""
        end = start + PIECE_CHARS
        if end >= len(text):
            return len(text)
        lo = max(start + 1, end - CUT_SEARCH)  # a cut after `start`: every piece holds something
        checked = 0
        if self.path not in _inexact:  # a tokenizer that failed every check once is not asked again
            for before in _CUT_BEFORE:
                cuts = [m.start() for m in before.finditer(text, lo, end + 1)]
                for c in reversed(cuts[-CUT_TRIES:]):
                    checked += 1
                    if self._exact_at(text, c):
                        return c
        if checked:
            _inexact.add(self.path)
        spaces = [m.start() for m in _WHITESPACE.finditer(text, lo, end + 1)]
        if self.path not in _said_inexact:
            _said_inexact.add(self.path)
            log.warning(
                "%s: a document over %d characters is tokenized in pieces, and near character %d %s: the "
                "tokens at such cuts may differ from the whole document's",
                self.path, PIECE_CHARS, end,
                "no cut keeps this tokenizer's ids as they are whole" if spaces else "there is no whitespace",
            )  # fmt: skip
        return spaces[-1] if spaces else end

    def _exact_at(self, text: str, c: int) -> bool:
        """Whether the tokenizer gives the text around `c` the same ids whole and cut at `c`: asked of the
        tokenizer itself, so its pre-tokenizer, normalizer and added tokens all have their say."""
        lo, hi = max(0, c - CUT_CONTEXT), c + CUT_CONTEXT
        tok = self.tokenizer
        whole, left, right = tok.encode_batch([text[lo:hi], text[lo:c], text[c:hi]], add_special_tokens=False)
        return whole.ids == left.ids + right.ids


def load_tokenizer(path: str | Path | None = None, data: Sequence[str] = ()) -> TokenizerInfo:
    """Load a tokenizer.json (the built-in one when `path` is None) and find its end-of-text token. Loaded
    once per process and file version: the launcher's checks load it, and the producers it forks reuse it.
    `data` is the run's --data: when it is a local shard directory whose meta.json recorded this very file
    (same sha256), the facts come from there and the file is parsed only if something tokenizes."""
    p = Path(path) if path else BUILTIN_PATH
    if p.is_dir():
        raise FileNotFoundError(f"{p} is a directory; name its tokenizer.json")
    if not p.is_file():
        hint = ""
        if p.suffix.lower() != ".json" and len(p.parts) <= 2 and not p.is_absolute():  # `gpt2`, `org/model`
            hint = (
                "; --tokenizer takes a tokenizer.json file (Hugging Face tokenizers' format), not a model "
                "name: nothing is downloaded. Save one where it can be read (e.g. "
                "AutoTokenizer.from_pretrained(NAME).backend_tokenizer.save('tokenizer.json') on a machine "
                "with the model), or train one with `lmpipe tokenizer train`; leave it out for the built-in one"
            )
        raise FileNotFoundError(f"tokenizer file not found: {p}{hint}")
    st = p.stat()
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    info = _loaded.get(key)
    if info is None:
        raw = p.read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        rec = _recorded(data)
        if rec is not None and rec["file_sha256"] == sha:
            info = TokenizerInfo(**rec, path=key[0], _key=key)
        else:
            try:
                info = _facts(key, sha)
            except ValueError as exc:
                raise ValueError(f"{p}: {exc}") from None
        _loaded[key] = info
    return replace(info, path=str(p))


_loaded: dict[tuple[str, int, int], TokenizerInfo] = {}


def _recorded(data: Sequence[str]) -> dict[str, Any] | None:
    """The tokenizer facts a local shard directory's meta.json recorded, if `data` is one (a path or a
    file:// URL) and they are well-formed (anything else: None, and the file is parsed; the shard reader
    reports a damaged meta.json)."""
    try:
        local = local_path(data[0]) if len(data) == 1 else None
    except ValueError:  # a file:// URL of another host: the producer says so
        return None
    if local is None:
        return None
    try:
        rec = json.loads((Path(local) / SHARD_META).read_bytes()).get("tokenizer")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return rec if facts_well_formed(rec) and rec.keys() == FACTS.keys() else None


@functools.lru_cache(maxsize=8)
def _parse(path: str, mtime_ns: int, size: int) -> Tokenizer:
    st = os.stat(path)
    if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
        raise ValueError("the tokenizer file changed while in use; start again")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:
        raise ValueError(f"not a Hugging Face tokenizer.json ({exc})") from None
    # A file saved with padding or truncation on would pad every document to the longest of its encode call
    # and cut long ones (each piece of one, too): lmpipe packs, pads and splits documents itself.
    if tok.padding is not None or tok.truncation is not None:
        log.info("%s: its padding and truncation settings are left off (lmpipe packs and splits documents)",
                 path)  # fmt: skip
        tok.no_padding()
        tok.no_truncation()
    return tok


def _facts(key: tuple[str, int, int], file_sha256: str) -> TokenizerInfo:
    tok = _parse(*key)
    eos = next((tok.token_to_id(t) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(f"no end-of-text token; expected one of {', '.join(EOS_CANDIDATES)}")
    pad = tok.token_to_id("<|pad|>")
    return TokenizerInfo(
        path=key[0],
        hash=hashlib.sha256(tok.to_str().encode()).hexdigest()[:16],
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=eos,
        pad_id=eos if pad is None else pad,  # pads are never trained on, so eos is a safe filler
        file_sha256=file_sha256,
        _key=key,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, show_progress: bool = False) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with `<|endoftext|>` as its only special token. `show_progress`: the
    tokenizers library's own bars (pair counting, merges), for a terminal."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
