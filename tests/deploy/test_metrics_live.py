"""/metrics of every process, scraped over HTTP during and after a real `lmpipe run`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from lmpipe.shared.metrics import (
    BAD_RECORD_REASONS,
    CACHES,
    GPU_MEMORY_KINDS,
    REJECT_REASONS,
    STALE_REASONS,
)
from lmpipe.shared.tokenizer import load_tokenizer
from tests.deploy.scrape import Scrape, scrape, wait_for_scrape
from tests.helpers import GARBAGE, Procs, free_port_pair, free_ports, push_garbage


class FiniteRun:
    def __init__(self, tmp: Path):
        self.procs = Procs(tmp)
        self.data_port = free_port_pair()
        self.metrics_port = free_ports(3, avoid={self.data_port, self.data_port + 1})
        self.trainer_mid: Scrape | None = None
        self.trainer: Scrape | None = None
        self.producers: list[Scrape] = []
        self.log = ""

    def run(self) -> None:
        p = self.procs.start(
            "run", "--metrics-port", str(self.metrics_port), "--metrics-linger", "15", "--epochs", "1",
            "--steps", "0", "--builtin-docs", "400", "--port", str(self.data_port), "--log-every", "5",
            name="run",
        )  # fmt: skip
        self.procs.wait_for(p, "listening on", timeout=60)
        push_garbage(self.data_port, GARBAGE)
        # during training: the first scrape that shows trained tokens (or the last, if training was quicker)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.trainer_mid = wait_for_scrape(self.metrics_port)
            if self.trainer_mid.get("lmpipe_trainer_tokens_total") > 0 or "summary:" in self.procs.log(p):
                break
            time.sleep(0.05)
        self.procs.wait_for(p, "summary:", timeout=120)
        assert p.poll() is None, "--metrics-linger keeps the run (and /metrics) up after training"
        self.trainer = scrape(self.metrics_port)
        self.producers = [scrape(self.metrics_port + 1 + i) for i in range(2)]
        self.log = self.procs.log(p)


@pytest.fixture(scope="module")
def finite_run(tmp_path_factory):
    run = FiniteRun(tmp_path_factory.mktemp("finite_run"))
    try:
        run.run()
        yield run
    finally:
        run.procs.cleanup()


# The minimum set of DESIGN.md, by process: sample names that must be served (with every known label value).
PRODUCER_MINIMUM = {
    "lmpipe_producer_documents_total": None,
    "lmpipe_producer_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_padding_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_batches_sent_total": None,
    "lmpipe_producer_bad_records_total": ("reason", BAD_RECORD_REASONS),
    "lmpipe_producer_tokenize_seconds_count": None,
    "lmpipe_producer_send_blocked_seconds_total": None,
}
TRAINER_MINIMUM = {
    "lmpipe_trainer_tokens_total": None,
    "lmpipe_trainer_steps_total": None,
    "lmpipe_trainer_step_seconds_count": None,
    "lmpipe_trainer_data_wait_seconds_count": None,
    "lmpipe_trainer_h2d_seconds_count": None,
    "lmpipe_trainer_batches_received_total": ("worker", ("0", "1")),
    "lmpipe_trainer_batches_rejected_total": ("reason", REJECT_REASONS),
    "lmpipe_trainer_stale_batches_total": ("reason", STALE_REASONS),
    "lmpipe_trainer_ready_slots": None,
    "lmpipe_trainer_loss": None,
    "lmpipe_trainer_learning_rate": None,
    "lmpipe_trainer_grad_norm": None,
    "lmpipe_trainer_loss_scale": None,
    "lmpipe_trainer_scaler_overflows_total": None,
    "lmpipe_trainer_skipped_steps_total": None,
    "lmpipe_trainer_cache_hits_total": ("cache", CACHES),
    "lmpipe_trainer_cache_misses_total": ("cache", CACHES),
    "lmpipe_trainer_compile_recompiles_total": None,
    "lmpipe_trainer_gpu_memory_bytes": ("kind", GPU_MEMORY_KINDS),
    "lmpipe_trainer_mfu_ratio": None,
}


def assert_serves(s: Scrape, minimum: dict, prefix: str) -> None:
    for name, labelled in minimum.items():
        if labelled is None:
            s.get(name)
        else:
            label, values = labelled
            assert set(values) <= set(s.by_label(name, label)), (
                f"{name}: {label} values {values} not all served"
            )
    foreign = {n for n in s.names() if n.startswith("lmpipe_") and not n.startswith(prefix)}
    assert not foreign, f"metrics of another process served here: {sorted(foreign)}"


@pytest.mark.slow
def test_every_minimum_metric_is_served_by_its_process_with_sane_values(finite_run):
    t, producers = finite_run.trainer, finite_run.producers
    assert_serves(t, TRAINER_MINIMUM, "lmpipe_trainer_")
    for p in producers:
        assert_serves(p, PRODUCER_MINIMUM, "lmpipe_producer_")

    steps = t.get("lmpipe_trainer_steps_total")
    assert steps > 0
    step_count, step_sum = t.histogram("lmpipe_trainer_step_seconds")
    wait_count, wait_sum = t.histogram("lmpipe_trainer_data_wait_seconds")
    assert step_count == wait_count == steps, "one step time and one data-wait time per step"
    assert step_sum > 0 and wait_sum <= step_sum, "step time includes its data wait"
    h2d_count, _ = t.histogram("lmpipe_trainer_h2d_seconds")
    assert h2d_count == steps, "one host-to-device copy (on CPU: the conversion) per batch trained"
    assert 0 <= t.get("lmpipe_trainer_ready_slots") <= 4, "at most the 2*accum+2 host slots"
    loss = t.get("lmpipe_trainer_loss")
    assert 0 < loss < math.log(load_tokenizer().vocab_size) + 1, "a cross-entropy near or below ln(vocab)"
    assert 0 < t.get("lmpipe_trainer_learning_rate") <= 3e-3, "within the schedule's peak"
    assert 0 < t.get("lmpipe_trainer_grad_norm") < math.inf
    assert t.get("lmpipe_trainer_loss_scale") == 1.0, "fp32 on CPU: no loss scaling"
    assert t.get("lmpipe_trainer_scaler_overflows_total") == 0
    assert t.get("lmpipe_trainer_skipped_steps_total") == 0
    assert t.get("lmpipe_trainer_compile_recompiles_total") == 0, "no --compile"
    assert set(t.by_label("lmpipe_trainer_gpu_memory_bytes", "kind").values()) == {0.0}, "CPU: no GPU memory"
    assert t.get("lmpipe_trainer_mfu_ratio") == 0.0, "CPU: MFU is not estimated"
    assert set(t.by_label("lmpipe_trainer_stale_batches_total", "reason").values()) == {0.0}
    assert t.get("lmpipe_trainer_producers_connected") == 2

    for p in producers:
        assert p.get("lmpipe_producer_documents_total") > 0
        assert p.get("lmpipe_producer_tokens_total", strategy="pack") > 0
        assert p.get("lmpipe_producer_batches_sent_total") > 0
        assert set(p.by_label("lmpipe_producer_bad_records_total", "reason").values()) == {0.0}, (
            "clean corpus"
        )
        count, total = p.histogram("lmpipe_producer_tokenize_seconds")
        assert count > 0 and total > 0
        assert p.get("lmpipe_producer_send_blocked_seconds_total") >= 0
        assert p.get("lmpipe_producer_handshakes_total", result="welcome") == 1

    mid = finite_run.trainer_mid
    for name in ("lmpipe_trainer_tokens_total", "lmpipe_trainer_steps_total"):
        assert 0 < mid.get(name) <= t.get(name), f"{name} was served during training and only grew"


@pytest.mark.slow
def test_tokens_sent_equal_tokens_trained(finite_run):
    t, producers = finite_run.trainer, finite_run.producers
    assert sum(p.get("lmpipe_producer_tokens_total", strategy="pack") for p in producers) == t.get(
        "lmpipe_trainer_tokens_total"
    )
    assert sum(p.get("lmpipe_producer_padding_tokens_total", strategy="pack") for p in producers) == t.get(
        "lmpipe_trainer_padding_tokens_total"
    )
    assert sum(p.get("lmpipe_producer_documents_total") for p in producers) == 400, "one epoch of 400 docs"
    sent = [p.get("lmpipe_producer_batches_sent_total") for p in producers]
    received = t.by_label("lmpipe_trainer_batches_received_total", "worker")
    assert sum(sent) == sum(received.values()), "every batch sent was received"
    assert all(sent), "every producer served shards"
    assert sum(sent) == t.get("lmpipe_trainer_steps_total"), "one batch per step (--accum 1)"
    assert "end of data" in finite_run.log


@pytest.mark.slow
def test_mask_cache_counters_move(finite_run):
    t = finite_run.trainer
    steps = t.get("lmpipe_trainer_steps_total")
    hits = t.get("lmpipe_trainer_cache_hits_total", cache="causal_mask")
    misses = t.get("lmpipe_trainer_cache_misses_total", cache="causal_mask")
    # pack on CPU: exact document masks over one causal mask of length seq_len, built once, then reused
    assert misses == 1 and hits > 0
    assert hits + misses >= steps, "at least one lookup per step"


@pytest.mark.slow
def test_injected_bad_messages_move_the_rejected_counter(finite_run):
    rejected = finite_run.trainer.by_label("lmpipe_trainer_batches_rejected_total", "reason")
    assert sum(rejected.values()) == len(GARBAGE), rejected
    assert finite_run.trainer.get("lmpipe_trainer_steps_total") > 0, "training went on"
