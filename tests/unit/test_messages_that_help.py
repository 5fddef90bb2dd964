"""Mistakes users make, each answered by a line that says what to do (issue: messages that mislead)."""

from __future__ import annotations

import pytest

from lmpipe.producer.control import unresolved
from lmpipe.shared.tokenizer import load_tokenizer


def test_a_trainer_host_that_does_not_resolve_is_named_in_the_waiting_line():
    why = unresolved("tcp://no-such-host.invalid:5556")
    assert "'no-such-host.invalid' does not resolve" in why
    assert unresolved("tcp://127.0.0.1:5556") == "" and unresolved("tcp://localhost:5556") == ""
    assert unresolved("ipc:///run/lmpipe/control") == ""


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-3.2-1B"])
def test_a_model_name_given_as_tokenizer_says_what_the_flag_takes(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(name)
    assert "not a model name" in str(err.value) and "tokenizer.json" in str(err.value)


def test_a_missing_tokenizer_file_is_just_missing(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(tmp_path / "tok.json")
    assert str(err.value) == f"tokenizer file not found: {tmp_path / 'tok.json'}"


def test_wikitext_s_blank_preamble_is_no_bad_record(tmp_path):
    from lmpipe.producer.formats.text import text_records

    f = tmp_path / "wiki.txt"
    f.write_text(" \n = Homarus = \n \n Homarus is a genus . \n = Other = \n text \n")
    recs = list(text_records(f, 0, "heading", 1 << 20))
    assert [r.bad for r in recs] == [None, None], "the blank preamble is not an empty document"
    assert [r.rid for r in recs] == [1, 2], "record numbering as before (checkpoints of earlier runs)"
    assert recs[0].text.startswith("= Homarus =")
    g = tmp_path / "empty.txt"
    g.write_text(" = A = \n a \n \n")
    assert [r.bad for r in text_records(g, 0, "heading", 1 << 20)] == [None]
