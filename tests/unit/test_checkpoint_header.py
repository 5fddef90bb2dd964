"""Issue 35 item 5: a checkpoint header whose format_version is not a version number is called malformed,
not "newer than this lmpipe"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmpipe.consumer.checkpoint import FORMAT_VERSION, CheckpointError, read_header


@pytest.mark.parametrize("version", [2.5, "3", True, None, 0, [3]])
def test_a_format_version_that_is_no_version_number_is_malformed(tmp_path: Path, version):
    (tmp_path / "header.json").write_text(json.dumps({"format_version": version}))
    with pytest.raises(CheckpointError, match="malformed header: format_version") as info:
        read_header(tmp_path)
    assert "newer" not in str(info.value)


def test_a_higher_version_is_newer(tmp_path: Path):
    (tmp_path / "header.json").write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(CheckpointError, match="is newer than this lmpipe"):
        read_header(tmp_path)
