"""bench.checkpoint_cost's CPU smoke form (its measurement runs on the GPU machine: scripts/gpu_check.sh
checkpoint-cost): the runs with and without checkpoints side by side, and a results file outside
bench/results. Run through its command line: tests import nothing of bench/."""

from __future__ import annotations

import datetime
import subprocess
import sys

from tests.helpers import REPO, lmpipe_env


def test_the_checkpoint_cost_bench_compares_runs_with_and_without_checkpoints(tmp_path):
    wikitext = tmp_path / "wt2"  # a small stand-in for WikiText-2: the smoke run checks the script
    wikitext.mkdir()
    text = "".join(f" = Heading {i} = \n\n Sentence {i} about item {i % 7} .\n\n" for i in range(300))
    for name in ("valid.txt", "test.txt"):
        (wikitext / name).write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "bench.checkpoint_cost", "--smoke", "--only", "none", "async",
         "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
        cwd=REPO, env={**lmpipe_env(), "LMPIPE_WIKITEXT": str(wikitext)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in out.stdout.splitlines() if r.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    assert set(rows) >= {"no checkpoints", "--checkpoint-mode async"}, out.stdout
    async_row = rows["--checkpoint-mode async"]
    assert float(async_row[0].replace(",", "")) > 0 and async_row[1].endswith("x"), async_row
    assert int(async_row[2]) >= 1 and float(async_row[3]) >= 0, "checkpoints in the timed steps, their stops"
    assert (tmp_path / "out" / f"checkpoint-cost-{datetime.date.today()}.md").is_file()
