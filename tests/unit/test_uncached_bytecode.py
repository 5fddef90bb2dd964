"""A start that must compile torch's Python source again (no bytecode cached, none allowed to be written) is
said in one line with the fix; one that can read or write the cache says nothing."""

from __future__ import annotations

import py_compile
import sys

from lmpipe.consumer.startup import uncached_bytecode


def module(tmp_path):
    src = tmp_path / "pkg" / "__init__.py"
    src.parent.mkdir()
    src.write_text("x = 1\n")
    return src


def test_no_cached_bytecode_and_none_written_is_said_with_the_fix(tmp_path, monkeypatch):
    src = module(tmp_path)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    line = uncached_bytecode(str(src))
    assert line is not None
    assert line.startswith(
        "torch's modules have no compiled bytecode here and PYTHONDONTWRITEBYTECODE is set"
    )
    assert f"python -m compileall -q {src.parent}" in line and "PYTHONPYCACHEPREFIX" in line
    # the same with an empty bytecode prefix (PYTHONPYCACHEPREFIX) in place of __pycache__
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "prefix"))
    assert uncached_bytecode(str(src)) is not None


def test_a_cache_this_start_can_write_or_one_already_there_says_nothing(tmp_path, monkeypatch):
    src = module(tmp_path)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert uncached_bytecode(str(src)) is None  # written by this start, read by the next
    py_compile.compile(str(src))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert uncached_bytecode(str(src)) is None  # compiled once: read at every start
    assert uncached_bytecode() is None  # this environment's torch has its bytecode
