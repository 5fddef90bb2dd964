"""A damaged or foreign Loader state is refused in one line (ValueError) and leaves the loader as it was:
never a KeyError or TypeError from deep inside, never cursors that fail only once iteration starts."""

from __future__ import annotations

import pytest

from lmpipe import Loader

GOOD_CURSOR = {"cursor": {"epoch": 0, "pos": 0, "offset": 0, "skip": 0}, "last_seq": 0, "finished": False}


def test_a_damaged_or_foreign_state_is_refused_in_one_line_and_changes_nothing():
    loader = Loader(seq_len=64, shards=2)
    good = loader.state_dict()
    damaged = [
        {"format": good["format"]},  # keys missing
        {**good, "identity": 5},
        {**good, "batches": "x"},
        {**good, "cursors": "junk"},
        {**good, "cursors": [{"x": 1}, {"x": 1}]},
        {**good, "cursors": [GOOD_CURSOR]},  # one shard's cursors for two shards
    ]
    for state in damaged:
        with pytest.raises(ValueError, match="damaged Loader state"):
            loader.load_state_dict(state)
    with pytest.raises(ValueError, match="format lmpipe.Loader/0; this lmpipe reads lmpipe.Loader/1"):
        loader.load_state_dict({**good, "format": "lmpipe.Loader/0"})
    assert loader.state_dict() == good  # nothing of the refused states was kept
