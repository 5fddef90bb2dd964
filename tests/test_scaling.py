"""Several producers into one trainer (1, 3, 6): every document once per epoch, every worker contributes
(none starves), and every worker shows in the metrics of the trainer and of its own process."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.deploy.scrape import scrape
from tests.helpers import assert_exactly_once, builtin_lengths, free_port_pair, free_ports, read_doc_log

pytestmark = pytest.mark.slow

DOCS = 600


@pytest.mark.parametrize("producers", [1, 3, 6])
def test_every_producer_contributes_and_every_document_is_trained_once(procs, tmp_path, tok, producers):
    port = free_port_pair()
    metrics = free_ports(producers + 1, avoid={port, port + 1})
    log = tmp_path / "docs.jsonl"
    p = procs.start(
        "run", "--producers", str(producers), "--epochs", "1", "--steps", "0", "--builtin-docs", str(DOCS),
        "--seq-len", "64", "--batch-size", "4", "--port", str(port), "--metrics-port", str(metrics),
        "--metrics-linger", "20", "--doc-log", str(log), "--log-every", "5", "--threads", "1",
        name="run",
    )  # fmt: skip
    procs.wait_for(p, "summary:", timeout=240)
    assert p.poll() is None, "--metrics-linger keeps /metrics up for the scrape"
    trainer = scrape(metrics)
    producer_sent = [
        scrape(metrics + 1 + i).get("lmpipe_producer_batches_sent_total", worker=str(i))
        for i in range(producers)
    ]

    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, DOCS))
    trained = Counter(
        b["worker"] for line in log.read_text().splitlines() for b in json.loads(line)["batches"]
    )
    assert sorted(trained) == list(range(producers)), trained
    mean = sum(trained.values()) / producers
    assert min(trained.values()) >= 0.5 * mean, f"a worker starved: {trained}"
    received = trainer.by_label("lmpipe_trainer_batches_received_total", "worker")
    assert {w: received[str(w)] for w in range(producers)} == {w: float(trained[w]) for w in range(producers)}
    assert all(sent >= trained[w] for w, sent in enumerate(producer_sent)), (producer_sent, trained)
