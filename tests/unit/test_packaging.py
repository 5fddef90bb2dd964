"""The installed distribution has one import name, `lmpipe`, and nothing in a user's directory shadows it."""

from __future__ import annotations

import tomllib

from tests.helpers import REPO


def test_one_tree_the_import_tree_is_the_source_tree():
    """producer/, consumer/ and shared/ live in lmpipe/, where they are imported from, so every tool (mypy, an
    editor, a reader of imports) sees one tree; the links at the top show the data flow; mypy checks it whole."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["mypy"]["files"] == ["lmpipe"]
    assert "package-dir" not in project["tool"]["setuptools"]
    for pkg in ("producer", "consumer", "shared"):
        real, link = REPO / "lmpipe" / pkg, REPO / pkg
        assert real.is_dir() and not real.is_symlink(), f"lmpipe/{pkg}/ holds the package's files"
        assert link.is_symlink() and link.resolve() == real.resolve(), f"{pkg} must link lmpipe/{pkg}"
