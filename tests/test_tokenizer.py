"""Tokenizer loading and encoding (shared/tokenizer.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lmpipe.shared import tokenizer
from lmpipe.shared.tokenizer import BUILTIN_PATH, load_tokenizer, train_tokenizer


def test_encode_ids_are_the_tokenizers_own_ids(tok):
    texts = [
        "A short one.",
        "",
        "  ",
        "naïve café — 漢字 🙂",
        "x" * 5000,
        "line one\nline two\n\n= Heading =\n",
    ]
    assert tok.encode_ids(texts) == [
        e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)
    ]


def test_a_tokenizer_file_is_loaded_once_until_it_changes(tmp_path):
    path = tmp_path / "tok.json"
    shutil.copy(BUILTIN_PATH, path)
    a, b = load_tokenizer(path), load_tokenizer(str(path))
    assert a.tokenizer is b.tokenizer  # forked producers reuse what the launcher's checks loaded
    assert a.path == str(path) and a.hash == b.hash
    train_tokenizer(["another corpus entirely"] * 50, vocab_size=300).save(str(path))
    os.utime(path, ns=(1, 1))  # a new file version even where the clock is coarse
    c = load_tokenizer(path)
    assert c.tokenizer is not a.tokenizer and c.hash != a.hash


def _forget_loaded() -> None:
    """As a fresh process: nothing loaded, nothing parsed."""
    tokenizer._loaded.clear()
    tokenizer._parse.cache_clear()


def _prepared(tmp_path, tok_path) -> tuple[Path, list[str]]:
    from lmpipe.producer.builtin_corpus import document
    from lmpipe.producer.shards import prepare
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream

    texts = [" ".join(document(5, i).split()) for i in range(30)]  # one paragraph each
    (tmp_path / "c.txt").write_text("\n\n".join(texts) + "\n")
    out = tmp_path / "shards"
    stream = DocStream(Corpus([str(tmp_path / "c.txt")]), load_tokenizer(tok_path), shuffle_window=0)
    prepare(stream, out, progress=False)
    return out, texts


def test_a_run_from_shards_takes_the_tokenizer_facts_prepare_recorded_and_parses_nothing(tmp_path):
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream

    path = tmp_path / "tok.json"
    shutil.copy(BUILTIN_PATH, path)
    shards, texts = _prepared(tmp_path, path)
    parsed = load_tokenizer(path)
    _forget_loaded()
    tok = load_tokenizer(path, [str(shards)])
    assert tok.facts() == parsed.facts() and tok.path == str(path)
    docs = list(DocStream(Corpus([str(shards)]), tok, shuffle_window=0).docs(0))  # a whole epoch
    assert len(docs) == len(texts) and tokenizer._parse.cache_info().misses == 0
    # whatever does need the tokenizer itself still gets it, parsed then
    assert tok.tokenizer.decode(docs[0].ids[:-1].tolist()) == texts[0]
    assert tokenizer._parse.cache_info().misses == 1


def test_shards_facts_count_only_for_the_very_file_they_were_recorded_from(tmp_path):
    path = tmp_path / "tok.json"
    shutil.copy(BUILTIN_PATH, path)
    shards, _ = _prepared(tmp_path, path)
    meta = json.loads((shards / "meta.json").read_text())
    # the same tokenizer saved with other whitespace: other bytes, so parsed; same canonical hash, so accepted
    path.write_text(json.dumps(json.loads(BUILTIN_PATH.read_text()), indent=4))
    _forget_loaded()
    same = load_tokenizer(path, [str(shards)])
    assert tokenizer._parse.cache_info().misses == 1
    assert same.hash == meta["tokenizer_hash"] and same.file_sha256 != meta["tokenizer"]["file_sha256"]
    # another tokenizer: its own facts, which the producer's check refuses against these shards
    train_tokenizer(["another corpus entirely"] * 50, vocab_size=300).save(str(path))
    os.utime(path, ns=(2, 2))
    other = load_tokenizer(path, [str(shards)])
    assert other.hash != meta["tokenizer_hash"] and other.vocab_size != meta["vocab_size"]
    # facts that are not well-formed are not used (opening the shards names the field: test_cli_errors)
    meta["tokenizer"]["eos_id"] = True
    (shards / "meta.json").write_text(json.dumps(meta))
    shutil.copy(BUILTIN_PATH, path)
    _forget_loaded()
    assert load_tokenizer(path, [str(shards)]).eos_id == 0
    assert tokenizer._parse.cache_info().misses == 1
