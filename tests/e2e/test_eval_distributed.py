"""--eval-data under torchrun (CPU, gloo): rank 0 evaluates with the bare model while the other rank waits
at the next step's all-reduce; the job ends cleanly and rank 0's summary holds each evaluation."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_lmpipe, short_texts, small_run


def test_rank_0_evaluates_for_a_two_rank_job(tmp_path: Path, port: int):
    (tmp_path / "held.txt").write_text("\n\n".join(short_texts(60, seed=3)))
    summary = tmp_path / "ddp.json"
    rc, out = run_lmpipe(
        tmp_path, "ddp", "run", *small_run(port, steps=4, warmup=1, log_every=2, producers=1, seq_len=64,
                                           batch_size=4, builtin_docs=400, summary_json=summary, threads=1),
        "--eval-data", str(tmp_path / "held.txt"), "--eval-every", "2", "--eval-batches", "2", nproc=2, timeout=240,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    d = json.loads(summary.read_text())
    assert [e["step"] for e in d["evals"]] == [2, 4]
    assert out.count("held-out batches") == 2, "rank 0 alone evaluates and says it"
