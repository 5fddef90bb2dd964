"""Mixture runs read through their doc logs (tests/e2e/test_mixture*.py): the sources' small corpora, the
--mix flags, and the trained sequence of (source, document, start, length) pieces."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import short_texts

SIZES = {"web": 1200, "code": 800, "math": 400}  # documents per source (of 1 to 6 words)


def corpus(tmp: Path) -> dict[str, Path]:
    out = {}
    for k, (name, n) in enumerate(SIZES.items()):
        path = out[name] = tmp / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in short_texts(n, seed=k + 1)))
    return out


def lengths(tok, files: dict[str, Path]) -> dict[tuple[str, int], int]:
    """(source, document) -> its tokens, end of text included."""
    out = {}
    for name, path in files.items():
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        for i, enc in enumerate(tok.tokenizer.encode_batch(texts, add_special_tokens=False)):
            out[name, i] = len(enc.ids) + 1
    return out


def mix(files: dict[str, Path], weights: tuple[float, ...]) -> list[str]:
    return ["--mix", *(f"{n}={files[n]}:{w}" for n, w in zip(files, weights))]


def sequence(entries: list[dict], skip_session: str = "", from_step: int = 0) -> list[tuple]:
    """Every trained piece in order: (source, document, start, length); the steps a killed session took at
    or past `from_step` are left out (its successor replays them)."""
    out = []
    for e in entries:
        if e["batches"][0]["session"] == skip_session and e["step"] >= from_step:
            continue
        for b in e["batches"]:
            out += [(b["source"], d, s, n) for d, s, n in b["docs"]]
    return out


def tokens_by_source(seq: list[tuple]) -> dict[str, int]:
    out: dict[str, int] = {}
    for source, _, _, n in seq:
        out[source] = out.get(source, 0) + n
    return out


def at_most_once(seq: list[tuple], expected: dict[tuple[str, int], int], whole: set[str]) -> None:
    """No token is trained twice; every document of the sources in `whole` is trained whole."""
    seen: dict[tuple[str, int], list[int]] = {}
    for source, d, s, n in seq:
        seen.setdefault((source, d), []).extend(range(s, s + n))
    for key, toks in seen.items():
        assert len(toks) == len(set(toks)), f"{key}: tokens trained twice"
        assert max(toks) < expected[key]
    for key, n in expected.items():
        if key[0] in whole:
            assert sorted(seen.get(key, [])) == list(range(n)), f"{key}: not trained exactly once"
