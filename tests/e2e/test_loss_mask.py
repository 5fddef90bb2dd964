"""Loss masks: prompt/completion and ids + loss_mask records, the mask through batching, the wire and the
host slots, targets that skip masked tokens (exactly zero gradient), exact accumulation, and real runs
(plain and from prepared shards) that train every document once and take the loss on exactly the unmasked
targets."""

from __future__ import annotations

import json
import os
import random
import signal
import urllib.request

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lmpipe.producer.shards import ShardSet
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from tests.corpora import write_finetune_corpus
from tests.helpers import (
    assert_exactly_once,
    doc_log_entries,
    doc_pieces,
    free_ports,
    wait_until,
)


def expected_docs(path, tok) -> dict[int, tuple[int, np.ndarray]]:
    """doc id -> (length, mask) of every good record, read by the pipeline's own stream."""
    stream = DocStream(Corpus([str(path)], vocab_size=tok.vocab_size), tok, shuffle_window=0)
    return {
        d.doc_id: (len(d.ids), np.ones(len(d.ids), np.uint8) if d.mask is None else d.mask)
        for d in stream.docs(0)
    }


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def check_run(log, summary, docs) -> None:
    """Every document trained exactly once, and the loss taken on exactly the trained targets inside the
    pieces the trainer logged: the producer's count, the trainer's and the corpus's agree."""
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0 and out["stale"] == 0
    entries = doc_log_entries(log)
    pieces = doc_pieces(entries)
    assert_exactly_once(pieces, {d: n for d, (n, _) in docs.items()})
    # a prompt/completion that fits a row (64) is never cut: its completion is trained with the prompt in view
    whole = {d: n for d, (n, mask) in docs.items() if n <= 64 and not mask.all()}
    assert whole and all(pieces[d] == [(0, n)] for d, n in whole.items())
    expected = sum(
        int(docs[did][1][start + 1 : start + n].sum())
        for e in entries
        for b in e["batches"]
        for did, start, n in b["docs"]
    )
    assert sum(b["targets"] for e in entries for b in e["batches"]) == out["targets"] == expected
    assert 0 < out["targets"] < out["tokens"] and np.isfinite(out["last_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_a_finetuning_run_trains_each_document_once_on_its_unmasked_targets(
    procs, tmp_path, port, tok, strategy
):
    data = tmp_path / "ft.jsonl"
    write_finetune_corpus(data)
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    mport = free_ports(3, avoid={port, port + 1})  # the trainer's /metrics, then producer 0's and 1's
    p = procs.start(
        "run", "--data", str(data), "--epochs", "1", "--steps", "0", "--seq-len", "64", "--batch-size", "4",
        "--strategy", strategy, "--producers", "2", "--shuffle-window", "50", "--port", str(port),
        "--metrics-port", str(mport), "--metrics-linger", "120", "--log-every", "20", "--doc-log", str(log),
        "--summary-json", str(summary), "--threads", "1", name="run",
    )  # fmt: skip
    procs.wait_for(p, "summary:", timeout=240)
    wait_until(summary.exists, 30, "the summary file")
    assert metric(mport, "lmpipe_trainer_loss_tokens_total") == json.loads(summary.read_text())["targets"]
    for reason in ("bad_mask", "bad_prompt"):
        assert (
            sum(metric(mport + 1 + i, "lmpipe_producer_bad_records_total", reason=reason) for i in (0, 1))
            == 1
        )
    # the work is done (the summary is written): a signal ends the 120 s linger at once, cleanly
    os.killpg(p.pid, signal.SIGTERM)
    assert procs.wait(p, 15) == 0
    text = procs.log(p)
    assert f"{data}:18: loss_mask must be a list of 2 values" in text
    assert f'{data}:102: "prompt" and "completion" must both be strings' in text
    assert "Traceback" not in text
    docs = expected_docs(data, tok)
    assert len(docs) == 238
    check_run(log, summary, docs)


@pytest.mark.slow
def test_prepared_shards_keep_the_mask_through_training(procs, tmp_path, port, tok):
    from lmpipe.cli import main

    data = tmp_path / "ft.jsonl"
    write_finetune_corpus(data, n=160, seed=1, plain_head=300)  # the first shard is all plain text
    out = tmp_path / "shards"
    assert main(["prepare", "--data", str(data), "--out", str(out), "--shard-tokens", "2000"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    with_mask = [k for k, sh in enumerate(meta["shards"]) if "mask" in sh["files"]]
    assert meta["format_version"] == 2 and with_mask and with_mask[0] > 0, "plain shards first, then masked"
    docs = expected_docs(data, tok)
    shards = ShardSet(out)
    for i in range(len(shards)):  # the shards hold each document's mask, end-of-text left out as for ids
        n, mask = docs[int(shards.rids[i])]
        got = shards.mask(i)
        np.testing.assert_array_equal(np.ones(n - 1, np.uint8) if got is None else got, mask[:-1])
        assert len(shards.ids(i)) == n - 1
    assert shards.mask(0) is None
    name = meta["shards"][with_mask[0]]["files"]["mask"]["name"]
    (out / name).write_bytes(b"")  # a mask cut short is named
    with pytest.raises(ValueError, match=rf"{name}: 0 bytes, meta.json says \d+"):
        ShardSet(out)
    assert main(["prepare", "--data", str(data), "--out", str(out), "--force", "--shard-tokens", "2000"]) == 0

    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", str(out), "--epochs", "1", "--steps", "0", "--seq-len", "64", "--batch-size", "4",
        "--producers", "2", "--port", str(port), "--metrics-port", "-1", "--log-every", "20",
        "--doc-log", str(log), "--summary-json", str(summary), "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=240) == 0, procs.log(p)
    check_run(log, summary, docs)


@pytest.mark.slow
def test_steps_without_a_trained_target_leave_the_model_alone(procs, tmp_path, port):
    """A corpus whose every token is masked (say, prompts cut off from their completions by --seq-len):
    AdamW would still move the weights on a zero gradient (momentum, weight decay), and the status line
    read loss 0.0000 as if the model were perfect. Each such step is counted and changes nothing."""
    data = tmp_path / "prompts-only.jsonl"
    rng = random.Random(3)
    lines = []
    for _ in range(40):
        ids = [rng.randint(1, 500) for _ in range(rng.randint(5, 60))]
        lines.append(json.dumps({"ids": ids, "loss_mask": [0] * len(ids)}))
    data.write_text("\n".join(lines) + "\n")
    ck, summary = tmp_path / "ck", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", str(data), "--steps", "3", "--seq-len", "32", "--batch-size", "2", "--accum", "2",
        "--producers", "1", "--port", str(port), "--metrics-port", "-1", "--log-every", "1",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep-checkpoints", "5",
        "--summary-json", str(summary), "--threads", "1", name="run",
    )  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    text = procs.log(p)
    assert "Traceback" not in text and "loss 0.0000" not in text, text
    assert text.count("no trained target") == 1, "said once, then counted"
    assert "3 steps without a trained target (no update)" in text
    out = json.loads(summary.read_text())
    assert out["steps"] == 3 and out["untrained_steps"] == 3 and out["targets"] == 0 and out["tokens"] > 0
    assert out["losses"] == []
    states = [torch.load(ck / f"step-{s:08d}" / "state.pt", weights_only=True) for s in (1, 3)]
    assert states[0]["model"].keys() == states[1]["model"].keys()
    for k, v in states[0]["model"].items():
        assert torch.equal(v, states[1]["model"][k]), k
    assert states[1]["optimizer"]["state"] == {}, "AdamW never stepped"


def test_fine_tuning_tables_say_what_lmpipe_reads_of_them(procs, tmp_path, port, caplog):
    """Parquet is how most fine-tuning sets ship. prompt/completion columns: one line saying masks come
    from JSONL (the run cannot start). input_ids with labels (-100 on the prompt): the labels are not
    read and every token is trained, which a user must be told rather than find out from the model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sft = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["Q1?", "Q2?"], "completion": [" a", " b"]}), sft)
    p = procs.start("run", "--data", str(sft), "--port", str(port), "--metrics-port", "-1", name="run")
    assert p.wait(timeout=60) == 2
    text = procs.log(p)
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert "prompt/completion records (loss masks) are read from JSONL only" in text

    tok = tmp_path / "tok.parquet"
    ids, labels = [[1, 2, 3, 4], [5, 6, 7]] * 3, [[-100, -100, 3, 4], [-100, 6, 7]] * 3
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), tok)
    with caplog.at_level("WARNING", logger="lmpipe.producer"):
        for _ in range(2):  # every epoch reopens the file: said once
            assert sum(r.bad is None for r in Corpus([str(tok)]).records()) == 6
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{tok}: column 'labels' is not read: every token of 'input_ids' is trained "
                    "(loss masks come from JSONL records with ids and loss_mask)"]  # fmt: skip
