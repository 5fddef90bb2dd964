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
)

DOCS = 240
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
