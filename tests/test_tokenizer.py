"""Tokenizer loading and encoding (shared/tokenizer.py)."""

from __future__ import annotations

import os
import shutil

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
