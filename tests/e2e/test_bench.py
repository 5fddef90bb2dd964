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


@pytest.mark.slow
def test_a_smoke_run_writes_to_a_temporary_folder_never_into_bench_results(tmp_path):
    wikitext = tmp_path / "wt2"  # a small stand-in for WikiText-2: the smoke run checks the script only
    wikitext.mkdir()
    text = "".join(
        f" = Heading {i} = \n\n Sentence {i} of a document about item {i % 7} .\n\n" for i in range(300)
    )
    (wikitext / "valid.txt").write_text(text)
    (wikitext / "test.txt").write_text(text)
    before = digest()
    out = bench("bench.precision", "--smoke", "--only", "bf16", "--work", str(tmp_path / "work"),
                env={"TMPDIR": str(tmp_path), "LMPIPE_WIKITEXT": str(wikitext)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert digest() == before, "a smoke run changed bench/results"
    assert (tmp_path / "lmpipe-bench-smoke" / f"precision-{datetime.date.today()}.md").is_file()


def test_precision_names_its_modes_when_none_matches():
    out = bench("bench.precision", "--smoke", "--only", "nothing")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--only nothing: no such mode here; the modes: fp32; fp16, no scaling;" in last, last


HOST_TIMERS = """
import argparse, sys, time
import torch
import bench.trainbench
from bench.host import PARTS, timed_parts
from bench.trainbench import common_args, warm_synthetic_steps

p = argparse.ArgumentParser()
common_args(p)
args = bench.trainbench.apply_smoke(p.parse_args(["--smoke", "--work", sys.argv[1], "--out", sys.argv[2]]))
args.warmup = 1
step = warm_synthetic_steps(args)
runner = step.trainer.runner
model, mask_builder, backward = runner.model, bench.trainbench.build_inputs, torch.autograd.backward
t0 = time.perf_counter()
with timed_parts(step) as spent:
    for i in range(3):
        step(i)
wall = time.perf_counter() - t0
outer = [part for part, inner in PARTS if not inner]
assert all(spent[part] > 0 for part in outer), dict(spent)
assert sum(spent[part] for part in outer) <= wall
assert spent["nvmath GEMM calls"] == 0  # a CPU step makes none
assert runner.model is model and bench.trainbench.build_inputs is mask_builder
assert torch.autograd.backward is backward and "step" not in vars(runner.optimizer)
step(3)  # and it still trains
print("ok")
"""


def test_bench_host_times_each_part_of_a_step_and_puts_the_step_back(tmp_path):
    """bench.host's timers wrap the functions a step calls: each part is timed, the parts fit inside the
    steps' wall time, and afterwards the step runs its own functions again (no timer left behind). The probe
    needs a GPU, so its timers run here on a CPU step, in a process of their own as the benchmarks run."""
    wikitext = tmp_path / "wt2"
    wikitext.mkdir()
    text = "".join(f" = Heading {i} = \n\n Sentence {i} about item {i % 7} .\n\n" for i in range(300))
    (wikitext / "valid.txt").write_text(text)
    (wikitext / "test.txt").write_text(text)
    out = subprocess.run(
        [sys.executable, "-c", HOST_TIMERS, str(tmp_path / "work"), str(tmp_path / "out")],
        cwd=REPO, env={**lmpipe_env(), "LMPIPE_WIKITEXT": str(wikitext)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
