"""Several producers into one trainer (1, 3, 6): every document once per epoch, every shard is served and
every producer contributes (none starves), as the metrics of the trainer and of each producer show."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.deploy.scrape import scrape
from tests.helpers import assert_exactly_once, builtin_lengths, free_port_pair, free_ports, read_doc_log

pytestmark = pytest.mark.slow

DOCS = 600
SHARDS = 12  # divisible by 1, 3 and 6: even shares


@pytest.mark.parametrize("producers", [1, 3, 6])
def test_every_producer_contributes_and_every_document_is_trained_once(procs, tmp_path, tok, producers):
    port = free_port_pair()
    metrics = free_ports(producers + 1, avoid={port, port + 1})
    log = tmp_path / "docs.jsonl"
    p = procs.start(
        "run", "--producers", str(producers), "--epochs", "1", "--steps", "0", "--builtin-docs", str(DOCS),
        "--seq-len", "64", "--batch-size", "4", "--port", str(port), "--metrics-port", str(metrics),
        "--metrics-linger", "20", "--doc-log", str(log), "--log-every", "5", "--threads", "1", "--shards", str(SHARDS),
        name="run",
    )  # fmt: skip
    procs.wait_for(p, "summary:", timeout=240)
    assert p.poll() is None, "--metrics-linger keeps /metrics up for the scrape"
    trainer = scrape(metrics)
    producer_sent = [
        scrape(metrics + 1 + i).get("lmpipe_producer_batches_sent_total", producer=str(i))
        for i in range(producers)
    ]

    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, DOCS))
    trained = Counter(
        b["shard"] for line in log.read_text().splitlines() for b in json.loads(line)["batches"]
    )
    assert sorted(trained) == list(range(SHARDS)), f"every shard was served: {trained}"
    received = trainer.by_label("lmpipe_trainer_batches_received_total", "shard")
    assert {s: received[str(s)] for s in range(SHARDS)} == {s: float(trained[s]) for s in range(SHARDS)}
    # each producer holds SHARDS / producers shards of about the same size: none starves
    mean = sum(producer_sent) / producers
    assert min(producer_sent) >= 0.5 * mean, f"a producer starved: {producer_sent}"
    assert sum(producer_sent) >= sum(trained.values()), (producer_sent, trained)
    assert trainer.get("lmpipe_trainer_producer_joins_total") == producers
    assert trainer.get("lmpipe_trainer_shards_per_producer", stat="max") == SHARDS // producers
