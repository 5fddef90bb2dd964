"""Tokenizer loading and encoding (shared/tokenizer.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

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


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_a_run_from_shards_takes_the_tokenizer_facts_prepare_recorded_and_parses_nothing(tmp_path, as_url):
    """The shard directory given as its path, or as a file:// URL (which was parsed: taken for remote)."""
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream

    path = tmp_path / "tok.json"
    shutil.copy(BUILTIN_PATH, path)
    shards, texts = _prepared(tmp_path, path)
    data = [shards.as_uri() if as_url else str(shards)]
    parsed = load_tokenizer(path)
    _forget_loaded()
    tok = load_tokenizer(path, data)
    assert tok.facts() == parsed.facts() and tok.path == str(path)
    assert tokenizer._parse.cache_info().misses == 0
    docs = list(DocStream(Corpus(data), tok, shuffle_window=0).docs(0))  # a whole epoch
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


# -- long texts in pieces, with tokenizers unlike the built-in one ------------------------------------------


def _words(n: int, sep: str) -> str:
    rng = random.Random(0)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "naïve", "café", "of", "history", "1905", "—"]
    return sep.join(rng.choice(vocab) for _ in range(n))


def _bpe(tmp_path: Path, name: str, pre=None, normalizer=None) -> tokenizer.TokenizerInfo:
    """A small BPE with `pre` as its pre-tokenizer, trained on the words the texts are made of, saved and
    loaded as a user's tokenizer.json is."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.normalizer = pre, normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False
    )
    tok.train_from_iterator([_words(2000, " "), _words(2000, "\n")], trainer=trainer)
    path = tmp_path / f"{name}.json"
    tok.save(str(path))
    return load_tokenizer(path)


def test_a_prefix_space_tokenizer_gets_its_whole_text_ids_from_cuts_before_spaces(
    tmp_path, monkeypatch, caplog
):
    """ByteLevel(add_prefix_space=True) adds a space to a piece that starts with a newline (one id more a
    cut, found by a hostile sweep), none to one that starts with a space: cuts go before spaces first."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 512)
    monkeypatch.setattr(tokenizer, "CUT_SEARCH", 128)
    info = _bpe(tmp_path, "prefix", pre=pre_tokenizers.ByteLevel(add_prefix_space=True))
    text = "\n".join(_words(12, " ") for _ in range(600))  # lines of words: spaces and newlines to cut at
    with caplog.at_level("WARNING", logger="lmpipe"):
        [ids] = info.encode_arrays([text])
    assert ids.tolist() == info.tokenizer.encode(text, add_special_tokens=False).ids
    assert "tokenized in pieces" not in caplog.text


def test_a_tokenizer_that_prepends_to_every_piece_is_said_once_to_differ(tmp_path, monkeypatch, caplog):
    """A Llama-2-style normalizer prepends '▁' to every text, so no cut keeps its ids: said once, and the
    pieces still hold every character."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 512)
    monkeypatch.setattr(tokenizer, "CUT_SEARCH", 128)
    info = _bpe(tmp_path, "prepend", normalizer=normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))  # fmt: skip
    text = _words(1500, " ")
    with caplog.at_level("WARNING", logger="lmpipe"):
        info.encode_arrays([text])
        info.encode_arrays([text])
    assert caplog.text.count("tokenized in pieces, and near character") == 1, caplog.text
    assert "no cut keeps this tokenizer's ids as they are whole" in caplog.text


def test_padding_and_truncation_saved_in_a_tokenizer_file_are_left_off(tmp_path):
    """A tokenizer.json saved with padding on padded every document to the longest of its encode call (and
    with truncation, cut each piece of a long one): 20,161 pad ids inside one document, found by a sweep."""
    tok = Tokenizer.from_file(str(BUILTIN_PATH))
    tok.enable_padding(pad_id=0)
    tok.enable_truncation(max_length=16)
    path = tmp_path / "padded.json"
    tok.save(str(path))
    info, plain = load_tokenizer(path), load_tokenizer()
    texts = ["a short document", "a much longer document, " * 40]
    assert [a.tolist() for a in info.encode_arrays(texts)] == [a.tolist() for a in plain.encode_arrays(texts)]
    assert info.encode_ids(texts) == plain.encode_ids(texts)
