"""A mixture's sources keep what a --data source can be: here a prepared shard set (memory-mapped, no
tokenizing) mixed with a prompt/completion JSONL (loss masks). Both are trained at their weights, each
piece named by its source in the doc log, and the completions' masks hold through the mixer's row copies
(fewer targets in the loss than tokens trained)."""

from __future__ import annotations

import json

import pytest

from tests.corpora import write_finetune_corpus
from tests.helpers import doc_log_entries, run_lmpipe, short_texts, small_run
from tests.mixruns import sequence, tokens_by_source

T, B, STEPS = 32, 4, 30


@pytest.mark.slow
def test_prepared_shards_and_a_loss_masked_source_in_one_mixture(tmp_path, port):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in short_texts(600, seed=3)))
    rc, out = run_lmpipe(
        tmp_path, "prepare", "prepare", "--data", str(plain), "--out", str(tmp_path / "shards")
    )
    assert rc == 0, out[-2000:]
    ft = tmp_path / "ft.jsonl"
    write_finetune_corpus(ft, n=200, seed=1)
    summary, log = tmp_path / "s.json", tmp_path / "docs.jsonl"
    rc, out = run_lmpipe(
        tmp_path, "mix", "run", "--mix", f"pre={tmp_path / 'shards'}:0.75", f"ft={ft}:0.25", "--epochs", "0",
        "--steps", str(STEPS), "--summary-json", str(summary),
        *small_run(port, seq_len=T, batch_size=B, strategy="pack", producers=2, shards=2, threads=1,
                   doc_log=log, metrics_port=None),
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    got = tokens_by_source(sequence(doc_log_entries(log)))
    total = sum(got.values())
    assert set(got) == {"pre", "ft"} and total == STEPS * B * T
    assert abs(got["pre"] - 0.75 * total) <= T and abs(got["ft"] - 0.25 * total) <= T, got
    # targets per source: without a mask, every token of a piece but its last predicts the next one
    targets: dict[str, int] = {}
    unmasked: dict[str, int] = {}
    for e in doc_log_entries(log):
        for b in e["batches"]:
            targets[b["source"]] = targets.get(b["source"], 0) + b["targets"]
            unmasked[b["source"]] = unmasked.get(b["source"], 0) + sum(n - 1 for _, _, n in b["docs"])
    assert targets["pre"] == unmasked["pre"], "plain text: every target trained"
    assert targets["ft"] < 0.8 * unmasked["ft"], "the prompts' masks held through the mixer's row copies"
    s = json.loads(summary.read_text())
    assert s["targets"] == sum(targets.values())
    assert {n: m["tokens"] for n, m in s["mixture"].items()} == got
