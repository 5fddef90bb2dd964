"""The benchmarks' own plumbing (their measurements run on the GPU machine: scripts/gpu_check.sh)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from bench.trainbench import apply_smoke, common_args
from tests.helpers import REPO, lmpipe_env


def test_a_smoke_run_never_writes_into_bench_results(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    p = argparse.ArgumentParser()
    common_args(p)
    args = apply_smoke(p.parse_args(["--smoke"]))
    assert args.out.startswith(str(tmp_path)), args.out  # the temporary folder, not bench/results
    assert apply_smoke(p.parse_args(["--smoke", "--out", "/x"])).out == "/x"  # unless told where
    assert apply_smoke(p.parse_args([])).out is None  # a real run writes its results


def test_precision_names_its_modes_when_none_matches():
    out = subprocess.run([sys.executable, "-m", "bench.precision", "--smoke", "--only", "nothing"], cwd=REPO,
                         env=lmpipe_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--only nothing: no such mode here; the modes: fp32; fp16, no scaling;" in last, last
