"""A resume refused because an object of a large corpus changed names that object, in a line of its own
size: it printed both corpora whole (755 characters for 24 objects)."""

from __future__ import annotations

import json

import pytest

from lmpipe.checks import check_resume_corpus
from lmpipe.consumer.config import TrainConfig
from lmpipe.producer.sources import Corpus
from lmpipe.shared.settings import SettingsError


def test_a_changed_object_among_many_is_named_and_the_rest_are_not(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(24):
        (data / f"part-{i:05d}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
    had = Corpus([str(data)]).fingerprint()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "header.json").write_text(json.dumps({"format_version": 1, "data": had}))
    (data / "part-00007.jsonl").write_text(json.dumps({"text": "document 7, rewritten longer"}) + "\n")
    with pytest.raises(SettingsError) as info:
        check_resume_corpus(Corpus([str(data)]), TrainConfig(resume=str(ck)))
    said = str(info.value)
    assert "trained on, not in --data now: 'part-00007.jsonl:" in said, said
    assert "in --data now, not trained on: 'part-00007.jsonl:" in said, said
    assert "part-00006" not in said and len(said) < 400, said
