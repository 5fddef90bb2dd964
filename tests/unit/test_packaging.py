"""The installed distribution has one import name, `lmpipe`, and nothing in a user's directory shadows it."""

from __future__ import annotations

import tomllib

from tests.helpers import REPO


def test_one_tree_the_import_tree_is_the_source_tree():
    """lmpipe/producer, lmpipe/consumer and lmpipe/shared are links to the folders at the top, so every tool
    (mypy, an editor, the editable install) sees one tree; mypy checks it whole."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["mypy"]["files"] == ["lmpipe"]
    assert "package-dir" not in project["tool"]["setuptools"]
    for pkg in ("producer", "consumer", "shared"):
        link = REPO / "lmpipe" / pkg
        assert link.is_symlink() and link.resolve() == (REPO / pkg).resolve(), (
            f"lmpipe/{pkg} must link ../{pkg}"
        )
