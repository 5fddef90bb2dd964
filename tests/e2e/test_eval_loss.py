"""`lmpipe run --eval-data`: a real run (forked producers, the trainer) scores held-out batches every
--eval-every steps and at the end, into the log line and the --summary-json. The held-out batches are
tokenized in the launcher after its producers are forked (a tokenizer used before the fork hung them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.helpers import run_lmpipe, short_texts, small_run


def test_run_logs_and_summarizes_the_eval_loss(tmp_path: Path, port: int):
    (tmp_path / "train.txt").write_text("\n\n".join(short_texts(200, seed=1)))
    (tmp_path / "held.txt").write_text("\n\n".join(short_texts(80, seed=2)))
    summary = tmp_path / "summary.json"
    rc, out = run_lmpipe(
        tmp_path, "run", "run", *small_run(port, steps=5, warmup=1, log_every=2, producers=1, seq_len=64,
                                           batch_size=4, data=tmp_path / "train.txt", summary_json=summary),
        "--eval-data", str(tmp_path / "held.txt"), "--eval-every", "2", "--eval-batches", "2", timeout=180,
    )  # fmt: skip
    assert rc == 0, out
    d = json.loads(summary.read_text())
    assert [e["step"] for e in d["evals"]] == [2, 4, 5]
    assert (
        all(math.isfinite(e["eval_loss"]) for e in d["evals"])
        and d["eval_loss"] == d["evals"][-1]["eval_loss"]
    )
    assert out.count("| eval loss ") == 4 and out.count("(2 held-out batches") == 3  # 3 evals, the summary
    assert f"eval loss {d['eval_loss']:.3f} (step 5)" in out  # the summary line
    assert all("lr" in row for row in d["history"])  # what `lmpipe plot` draws
