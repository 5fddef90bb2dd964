"""`data` as a user passes it: one path or several, str or pathlib.Path (Path raised a TypeError deep in the
settings' checks)."""

from __future__ import annotations

from lmpipe import Loader


def test_data_takes_paths_as_str_or_pathlib(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one document\n\nanother one\n")
    for data in (f, [f], (str(f),), str(f)):
        assert Loader(data=data, seq_len=64).cfg.data == [str(f)]
