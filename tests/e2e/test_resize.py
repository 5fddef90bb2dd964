"""A checkpoint of N trainer ranks resumes on M (torchrun, gloo on CPU): each rank takes its share of the
checkpoint's global shards with their cursors (consumer/reshard.py), and over the epoch every document is
trained exactly once, whatever the world sizes along the way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    rank_logs,
    run_lmpipe,
    small_run,
)
from tests.mixruns import at_most_once, corpus, lengths, mix, sequence, tokens_by_source

DOCS = 240
T, B = 32, 4  # the mixture's rows (tests/e2e/test_mixture.py's)
COMMON = ["--producers", "1", "--epochs", "1", "--builtin-docs", str(DOCS), "--seq-len", "64", "--batch-size", "4",
          "--metrics-port", "-1", "--log-every", "2", "--threads", "1"]  # fmt: skip


def phase(tmp: Path, port: int, name: str, ranks: int, *extra: str) -> tuple[str, dict]:
    """One run of the chain: `ranks` ranks (0: no torchrun), resuming the latest checkpoint if any."""
    rc, text = run_lmpipe(tmp, name, "run", *COMMON, "--port", str(port), "--checkpoint-dir", str(tmp / "ck"),
                          "--resume", "auto", "--doc-log", str(tmp / f"{name}.jsonl"),
                          "--summary-json", str(tmp / f"{name}.json"), *extra, nproc=ranks)  # fmt: skip
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text
    return text, json.loads((tmp / f"{name}.json").read_text())


def doc_logs(tmp: Path, names: list[str]) -> list[dict]:
    out = []
    for name in names:
        paths = rank_logs(tmp, name) or [tmp / f"{name}.jsonl"]
        out += [e for p in paths for e in doc_log_entries(p)]
    return out


@pytest.mark.slow
def test_one_to_two_to_four_ranks_trains_every_document_once(tmp_path, port, tok):
    # 1 rank, --shards 4: the run's shard space is 4 global shards, for good; 2 ranks take two each, 4 one
    _, one = phase(tmp_path, port, "one", 0, "--shards", "4", "--steps", "4")
    assert one["topology"] == {"world_size": 1, "shards": 4, "shard_space": 4}
    text, two = phase(tmp_path, port, "two", 2, "--shards", "4", "--steps", "8")
    assert "resuming a checkpoint of 1 rank on 2: the 4 shards are re-divided (rank 0: 0-1, rank 1: 2-3); the " \
           "global batch goes from 4 rows (1 x --accum 1 x 4) to 8 (2 x --accum 1 x 4)" in text  # fmt: skip
    assert two["topology"] == {"world_size": 2, "shards": 2, "shard_space": 4, "resumed_step": 4,
                               "resumed_world_size": 1}  # fmt: skip
    assert "resumed at 4, from 1 rank on 2" in text
    text, four = phase(tmp_path, port, "four", 4, "--shards", "4", "--steps", "0")
    assert "the 4 shards are re-divided (rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3)" in text
    assert four["stopped_by"] == "end of data" and four["topology"]["resumed_world_size"] == 2
    assert_exactly_once(doc_pieces(doc_logs(tmp_path, ["one", "two", "four"])), builtin_lengths(tok, DOCS))


@pytest.mark.slow
def test_two_ranks_resumed_on_one_keep_the_global_batch_and_learn_like_an_unresized_run(tmp_path, port, tok):
    # the unresized run: one rank, the same global batch of 8 rows (2 batches of 4 a step), to the epoch's end
    rc, text = run_lmpipe(tmp_path, "ref", "run", *COMMON, "--port", str(port), "--accum", "2", "--steps", "0",
                          "--summary-json", str(tmp_path / "ref.json"))  # fmt: skip
    assert rc == 0, text[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    phase(tmp_path, port, "two", 2, "--steps", "10")
    text, one = phase(tmp_path, port, "one", 0, "--steps", "0", "--keep-global-batch")
    assert "resuming a checkpoint of 2 ranks on 1: the 32 shards are re-divided (rank 0: 0-31); the global " \
           "batch stays 8 rows (1 rank x --accum 2 x 4)" in text  # fmt: skip
    assert one["stopped_by"] == "end of data"
    assert_exactly_once(doc_pieces(doc_logs(tmp_path, ["two", "one"])), builtin_lengths(tok, DOCS))
    # The same documents, the same global batch and learning rate at every step: only the order of the
    # documents differs, so the end of the curve agrees as an unresized 2-rank run's does with one rank's
    # (tests/e2e/test_distributed.py: within 15% of the tail mean), while the model learned over 1.0 nat.
    assert ref["first_loss"] - ref["last_loss"] > 1.0, "the model learns"
    tail = [sum(run["losses"][-4:]) / 4 for run in (one, ref)]
    assert abs(tail[0] - tail[1]) < 0.15 * tail[1], (one["losses"], ref["losses"])


@pytest.mark.slow
def test_a_mixture_resumed_on_fewer_ranks_keeps_its_shares_and_every_document_once(tmp_path, port, tok):
    files = corpus(tmp_path)
    weights = (0.3, 0.2, 0.5)  # math (the smallest source) is due most: it runs out first and ends the run
    args = [*mix(files, weights), "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto",
            *small_run(port, seq_len=T, batch_size=B, strategy="pack", seed=7, producers=1, shards=2, threads=1)]  # fmt: skip
    rc, out = run_lmpipe(tmp_path, "two", "run", *args, "--steps", "8", "--doc-log", str(tmp_path / "two.jsonl"),
                         nproc=2)  # fmt: skip
    assert rc == 0, out[-3000:]
    rc, out = run_lmpipe(tmp_path, "one", "run", *args, "--steps", "0", "--doc-log", str(tmp_path / "one.jsonl"),
                         "--summary-json", str(tmp_path / "one.json"))  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "resuming a checkpoint of 2 ranks on 1: the 4 shards are re-divided (rank 0: 0-3)" in out
    seq = sequence(doc_logs(tmp_path, ["two", "one"]))
    at_most_once(seq, lengths(tok, files), whole={"math"})
    got = tokens_by_source(seq)
    # each new rank's mixer starts from the job's summed tokens and deficits: the run's shares stay exact
    # within a row per rank of the checkpoint and source, as a run on one rank's do within a row
    total = sum(got.values())
    for name, w in zip(files, weights):
        assert abs(got[name] - w * total) <= 2 * T, (name, got, total)
    mixture = json.loads((tmp_path / "one.json").read_text())["mixture"]
    assert {n: m["tokens"] for n, m in mixture.items()} == got  # the whole job's, both world sizes
