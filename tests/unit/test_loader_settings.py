"""The Loader's constructor and state checks, in-process (nothing starts before iteration): settings as
the CLI validates them, and a state of other settings or another rank refused in one line."""

from __future__ import annotations

import pytest

from lmpipe import Loader
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError


def test_settings_are_validated_as_the_clis():
    with pytest.raises(SettingsError, match="seq-len 1"):
        Loader(seq_len=1)
    with pytest.raises(SettingsError, match="corpus file not found"):
        Loader(data="no/such/file.txt")
    with pytest.raises(TypeError, match="unknown settings seqlen"):
        Loader(seqlen=64)
    loader = Loader(PipelineConfig(seq_len=64), batch_size=2)  # a config, keywords on top
    assert loader.cfg.seq_len == 64 and loader.cfg.batch_size == 2
    with pytest.raises(TypeError, match="known only at its end"):
        len(loader)


def test_a_state_of_other_settings_or_another_rank_is_refused(monkeypatch):
    state = Loader(seq_len=64).state_dict()
    assert state["cursors"] is None and state["batches"] == 0
    with pytest.raises(ValueError, match="another stream settings"):
        Loader(seq_len=128).load_state_dict(state)
    with pytest.raises(ValueError, match="another number of shards"):
        Loader(seq_len=64, shards=8).load_state_dict(state)
    with pytest.raises(ValueError, match="not a Loader state"):
        Loader(seq_len=64).load_state_dict({"cursors": []})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="rank 0 of 1, this loader rank 1 of 2"):
        Loader(seq_len=64).load_state_dict(state)
    own = Loader(seq_len=64).state_dict()
    Loader(seq_len=64).load_state_dict(own)  # its own rank's: taken
    assert (own["rank"], own["world_size"]) == (1, 2)
