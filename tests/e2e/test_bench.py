"""The benchmarks' own plumbing, run as users run them (their measurements run on the GPU machine:
scripts/gpu_check.sh)."""

from __future__ import annotations

import datetime
import hashlib
import subprocess
import sys

import pytest

from tests.helpers import REPO, lmpipe_env

RESULTS = REPO / "bench" / "results"


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env={**lmpipe_env(), **(env or {})},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def digest() -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir()) if p.is_file()
    }


def stand_in_wikitext(tmp_path) -> str:
    """A small stand-in for WikiText-2 (the smoke runs check the scripts, not the corpus): the GPU machine
    has no copy of the team folder, and the tests pass no LMPIPE_WIKITEXT through."""
    wikitext = tmp_path / "wt2"
    wikitext.mkdir()
    text = "".join(
        f" = Heading {i} = \n\n Sentence {i} of a document about item {i % 7} .\n\n" for i in range(300)
    )
    (wikitext / "valid.txt").write_text(text)
    (wikitext / "test.txt").write_text(text)
    return str(wikitext)


@pytest.mark.slow
def test_a_smoke_run_writes_to_a_temporary_folder_never_into_bench_results(tmp_path):
    wikitext = stand_in_wikitext(tmp_path)
    before = digest()
    out = bench("bench.precision", "--smoke", "--only", "bf16", "--work", str(tmp_path / "work"),
                env={"TMPDIR": str(tmp_path), "LMPIPE_WIKITEXT": wikitext})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert digest() == before, "a smoke run changed bench/results"
    assert (tmp_path / "lmpipe-bench-smoke" / f"precision-{datetime.date.today()}.md").is_file()


def test_precision_names_its_modes_when_none_matches():
    out = bench("bench.precision", "--smoke", "--only", "nothing")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--only nothing: no such mode here; the modes: fp32; fp16, no scaling;" in last, last


@pytest.mark.cuda
def test_bench_host_times_each_part_of_a_step_and_writes_outside_bench_results(tmp_path):
    """bench.host as users run it (its probe needs a GPU): each part of a step is timed and listed, and a
    smoke run leaves bench/results alone. Run through its command line: tests import nothing of bench/."""
    before = digest()
    out = bench("bench.host", "--smoke", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                env={"TMPDIR": str(tmp_path), "LMPIPE_WIKITEXT": stand_in_wikitext(tmp_path)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    parts = out.stdout.split("Host ms a step by part", 1)
    assert len(parts) == 2, out.stdout[-3000:]
    rows = [line for line in parts[1].split("\n\n")[1].splitlines() if line.startswith("|")][2:]
    assert rows and all(float(r.split("|")[2].replace(",", "")) >= 0 for r in rows), parts[1][:2000]
    assert digest() == before, "a smoke run changed bench/results"


@pytest.mark.parametrize("module", ["bench.warm_start", "bench.checkpoint_write", "bench.mixture"])
def test_the_session_s_gpu_benchmarks_start(module):
    """Their measurements ran on an H200 (bench/results/*-h200-2026-11-28*.md); here, within CI's budget,
    that each still imports and parses its command line (bench.checkpoint_cost keeps a smoke run:
    tests/e2e/test_checkpoint_cost.py)."""
    out = bench(module, "--help")
    assert out.returncode == 0 and "--out" in out.stdout, out.stderr[-2000:]
