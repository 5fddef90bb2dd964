"""A restart of a --compile run finds what the last one compiled beside its checkpoints, says so in one line at
the start, and its summary splits the time to the first step (start-up, compile, first batch wait)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers import run_lmpipe, small_run


def test_a_resumed_compile_run_starts_warm_and_splits_its_first_step(tmp_path, port, monkeypatch):
    if sys.platform != "linux":
        pytest.skip("torch.compile on CPU needs a C++ compiler; CI is Linux")
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor")
    )  # torch's own, apart from others'
    ck = tmp_path / "ck"
    flags = small_run(port, compile=True, builtin_docs=100, seq_len=32, batch_size=2, log_every=1,
                      checkpoint_dir=ck, device="cpu")  # fmt: skip
    rc, first = run_lmpipe(
        tmp_path, "first", "run", *flags, "--steps", "2", "--summary-json", str(tmp_path / "1.json")
    )
    assert rc == 0, first[-3000:]
    assert re.search(
        r"compile cache: cold \(none yet in .*compile-cache; written after the first step\)", first
    )
    assert "compile cache: 1 graph(s) saved in" in first, first[-3000:]
    got = json.loads((tmp_path / "1.json").read_text())["first_step_split"]
    assert got["compile_cache"] == "cold" and got["compiled_ahead"] and got["compile_cache_misses"] > 0, got
    assert got["first_step_recompiles"] == 0, got  # the graph compiled ahead is the one the first batch ran
    assert got["total"] >= got["startup"] + got["compile"] > got["compile"] > 0, got
    rc, second = run_lmpipe(tmp_path, "second", "run", *flags, "--steps", "4", "--resume", "auto",
                            "--summary-json", str(tmp_path / "2.json"))  # fmt: skip
    assert rc == 0, second[-3000:]
    assert (
        len(re.findall(r"compile cache: warm \(.*compile-cache: 1 graph\(s\), saved at step 1, ", second))
        == 1
    )
    got = json.loads((tmp_path / "2.json").read_text())["first_step_split"]
    assert (
        got["compile_cache"] == "warm" and got["compile_cache_hits"] > 0 and got["compile_cache_misses"] == 0
    )
    assert "graph(s) saved" not in second  # nothing new to write
    line = next(ln for ln in second.splitlines() if "summary:" in ln)
    assert re.search(
        r"first step [\d.]+ s after start \(start-up [\d.]+ s, compile [\d.]+ s, cache warm, ", line
    )
