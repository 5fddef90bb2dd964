"""A mixture under torchrun (2 CPU ranks, gloo): each rank mixes its own shards of every source, so each
rank's tokens per source follow the weights to within one row; no document is trained twice across the
ranks; a rank whose source ran out takes no more data and steps with the others (as at the end of an
unmixed epoch) until the job ends, and nobody hangs."""

from __future__ import annotations

import pytest

from tests.helpers import doc_log_entries, rank_logs, run_lmpipe, small_run
from tests.mixruns import at_most_once, corpus, lengths, mix, sequence, tokens_by_source

T, B = 32, 4


@pytest.mark.slow
def test_two_ranks_each_mix_their_shards_and_stop_together(tmp_path, port, tok):
    files = corpus(tmp_path)
    weights = (0.5, 0.35, 0.15)
    own = small_run(None, shards=2, threads=1, doc_log=tmp_path / "docs.jsonl", metrics_port=None)
    rc, out = run_lmpipe(tmp_path, "ranks", "run", *mix(files, weights), "--epochs", "1", "--steps", "0",
                         *small_run(port, seq_len=T, batch_size=B, strategy="pack", seed=7, producers=1), *own,
                         nproc=2)  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "has no more data" in out, "the job ended when a source ran out"
    logs = rank_logs(tmp_path, "docs")
    assert [p.name for p in logs] == ["docs.rank0.jsonl", "docs.rank1.jsonl"]
    entries = [doc_log_entries(p) for p in logs]
    assert len(entries[0]) == len(entries[1]) > 10, "the ranks stepped together"
    seqs = [sequence([e for e in mine if e["batches"]]) for mine in entries]  # no batch: its source ran out
    for mine, seq in zip(entries, seqs):
        got = tokens_by_source(seq)
        total = sum(got.values())
        assert total <= sum(1 for e in mine if e["batches"]) * B * T
        for name, w in zip(files, weights):
            assert abs(got[name] - w * total) <= T, (name, got, total)
    keys = [{(s, d) for s, d, _, _ in seq} for seq in seqs]
    assert not keys[0] & keys[1], "each rank has its own share of every source"
    at_most_once(seqs[0] + seqs[1], lengths(tok, files), whole=set())
