"""/metrics of every process, scraped over HTTP during and after a real `lmpipe run`."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from lmpipe.shared import __version__
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
    "lmpipe_producer_documents_total": ("producer", None),
    "lmpipe_producer_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_padding_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_batches_sent_total": ("producer", None),
    "lmpipe_producer_bad_records_total": ("reason", BAD_RECORD_REASONS),
    "lmpipe_producer_tokenize_seconds_count": ("producer", None),
    "lmpipe_producer_send_blocked_seconds_total": ("producer", None),
}
TRAINER_MINIMUM = {
    "lmpipe_trainer_tokens_total": None,
    "lmpipe_trainer_steps_total": None,
    "lmpipe_trainer_global_step": None,
    "lmpipe_trainer_step_seconds_count": None,
    "lmpipe_trainer_data_wait_seconds_count": None,
    "lmpipe_trainer_h2d_seconds_count": None,
    "lmpipe_trainer_batches_received_total": ("shard", ("0", "1")),
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
            served = s.by_label(name, label)
            assert served, f"{name}: no series with a {label} label"
            assert values is None or set(values) <= set(served), (
                f"{name}: {label} values {values} not all served"
            )
    foreign = {
        n for n in s.names() if n.startswith("lmpipe_") and not n.startswith((prefix, "lmpipe_build_"))
    }
    assert not foreign, f"metrics of another process served here: {sorted(foreign)}"
    assert not {n for n in s.names() if n.endswith("_created")}, (
        "no _created series (disable_created_metrics)"
    )
    (build,) = [dict(lb) for (n, lb), v in s.samples.items() if n == "lmpipe_build_info" and v == 1]
    assert build["version"] == __version__ and build["role"] == prefix.split("_")[1], build


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
    assert step_count == steps, "one step time per step"
    # one data-wait time per step, and one more for the last wait, which ended with no batch (the end of
    # the data): waiting for nothing is waiting too (runstats.waited_for_nothing)
    assert wait_count - steps in (0, 1), (wait_count, steps)
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
    gpu = t.by_label("lmpipe_trainer_gpu_memory_bytes", "kind").values()
    assert all(math.isnan(v) for v in gpu), (
        "CPU: no GPU memory reading, NaN rather than a 0 that reads as one"
    )
    assert math.isnan(t.get("lmpipe_trainer_mfu_ratio")), "CPU: MFU is not estimated (NaN, not 0)"
    assert t.get("lmpipe_trainer_global_step") == steps, "a fresh run: the global step is the steps taken"
    assert math.isnan(t.get("lmpipe_trainer_checkpoint_timestamp_seconds")), "no --checkpoint-dir"
    # the info metrics carry ids and settings, never prose (a label value is a short code or a number)
    for s in (t, *producers):
        for (name, labels), _ in s.samples.items():
            if name.endswith("_info"):
                for k, v in labels:
                    assert re.fullmatch(r"[A-Za-z0-9_.:+-]{1,40}", v), f"{name}{{{k}={v!r}}} reads as prose"
    assert set(t.by_label("lmpipe_trainer_stale_batches_total", "reason").values()) == {0.0}
    assert t.get("lmpipe_trainer_producers_connected") == 2

    workers, held = set(), set()
    for p in producers:
        # every producer series carries its number: `lmpipe run` starts producer i with --worker i
        (w,) = {dict(lb).get("producer") for (n, lb) in p.samples if n.startswith("lmpipe_producer_")}
        workers.add(w)
        assert p.get("lmpipe_producer_documents_total", producer=w) > 0
        assert p.get("lmpipe_producer_tokens_total", strategy="pack", producer=w) > 0
        assert p.get("lmpipe_producer_batches_sent_total", producer=w) > 0
        assert set(p.by_label("lmpipe_producer_bad_records_total", "reason").values()) == {0.0}, (
            "clean corpus"
        )
        count, total = p.histogram("lmpipe_producer_tokenize_seconds", producer=w)
        assert count > 0 and total > 0
        assert p.get("lmpipe_producer_send_blocked_seconds_total", producer=w) >= 0
        assert p.get("lmpipe_producer_handshakes_total", result="welcome", producer=w) == 1
        # per shard held (a producer holds several): one epoch, counted from 0, and where each shard stands
        epochs = p.by_label("lmpipe_producer_epoch", "shard")
        positions = p.by_label("lmpipe_producer_cursor_position", "shard")
        assert epochs and set(epochs.values()) == {0} and set(positions) == set(epochs), (epochs, positions)
        assert all(v > 0 for v in positions.values()), positions
        assert not held & set(epochs), "a shard has one holder"
        held |= set(epochs)
    assert workers == {"0", "1"}, "the producers' own numbers, as in their log lines' [producer N]"
    assert held == set(t.by_label("lmpipe_trainer_batches_received_total", "shard")), (
        "the producers' shard ids are the trainer's: the two join on `shard`"
    )

    mid = finite_run.trainer_mid
    for name in ("lmpipe_trainer_tokens_total", "lmpipe_trainer_steps_total"):
        assert 0 < mid.get(name) <= t.get(name), f"{name} was served during training and only grew"


def total(s: Scrape, name: str) -> float:
    return sum(v for (n, _), v in s.samples.items() if n == name)


@pytest.mark.slow
def test_tokens_sent_equal_tokens_trained(finite_run):
    t, producers = finite_run.trainer, finite_run.producers
    assert sum(total(p, "lmpipe_producer_tokens_total") for p in producers) == t.get(
        "lmpipe_trainer_tokens_total"
    )
    assert sum(total(p, "lmpipe_producer_padding_tokens_total") for p in producers) == t.get(
        "lmpipe_trainer_padding_tokens_total"
    )
    assert sum(total(p, "lmpipe_producer_documents_total") for p in producers) == 400, "one epoch of 400 docs"
    sent: dict[str, float] = {}
    for p in producers:
        sent.update(p.by_label("lmpipe_producer_batches_sent_total", "producer"))
    received = t.by_label("lmpipe_trainer_batches_received_total", "shard")
    # producers label their series with their own --worker number, the trainer with shards: totals agree
    assert sum(sent.values()) == sum(received.values()), "every batch sent was received"
    assert sum(sent.values()) == t.get("lmpipe_trainer_steps_total"), "one batch per step (--accum 1)"
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


@pytest.mark.slow
def test_the_global_step_and_checkpoint_gauges_survive_a_resume(procs, tmp_path):
    """steps_total counts this process's steps (a counter restarts with its process); global_step and the
    checkpoint gauges are the run's, read from the checkpoint at start."""
    ck = tmp_path / "ck"
    common = ["--builtin-docs", "200", "--seq-len", "64", "--batch-size", "4", "--checkpoint-dir", str(ck),
              "--threads", "1"]  # fmt: skip
    first = procs.start("run", *common, "--steps", "6", "--port", str(free_port_pair()), name="first")
    assert first.wait(timeout=120) == 0, procs.log(first)
    before = time.time()
    port, mport = free_port_pair(), free_ports(3)
    second = procs.start("run", *common, "--steps", "10", "--resume", "auto", "--port", str(port),
                         "--metrics-port", str(mport), "--metrics-linger", "20", name="second")  # fmt: skip
    procs.wait_for(second, "resumed from", timeout=60)
    at_start = wait_for_scrape(mport)  # before or after its 4 steps, never 0 or NaN
    assert at_start.get("lmpipe_trainer_checkpoint_step") in (6, 10)
    assert at_start.get("lmpipe_trainer_global_step") >= 6, "the checkpoint's step, not 0"
    procs.wait_for(second, "summary:", timeout=120)
    t = scrape(mport)
    assert t.get("lmpipe_trainer_steps_total") == 4, "this process took 4 steps"
    assert t.get("lmpipe_trainer_global_step") == 10, "the run is at step 10"
    assert t.get("lmpipe_trainer_checkpoint_step") == 10, "the final checkpoint"
    assert before <= t.get("lmpipe_trainer_checkpoint_timestamp_seconds") <= time.time()
    count, total_s = t.histogram("lmpipe_trainer_checkpoint_seconds")
    assert count == 1 and total_s > 0, "one checkpoint written by this process"


@pytest.mark.slow
def test_handshake_refusals_are_counted_by_a_short_reason(procs, tmp_path):
    port, mport = free_port_pair(), free_ports(1)
    common = ["--port", str(port), "--producers", "1", "--builtin-docs", "100", "--batch-size", "4"]
    trainer = procs.start("train", *common, "--seq-len", "64", "--metrics-port", str(mport), name="trainer")
    procs.wait_for(trainer, "listening on", timeout=60)
    wrong = procs.start("produce", *common, "--seq-len", "32", "--worker", "0", name="wrong")
    assert wrong.wait(timeout=60) == 2, procs.log(wrong)
    # any --worker number and --producers count is welcome: the trainer assigns shards (README, Elastic
    # producers), so a producer started with other ones joins instead of being refused
    other = procs.start("produce", "--port", str(port), "--producers", "3", "--builtin-docs", "100",
                        "--batch-size", "4", "--seq-len", "64", "--worker", "2", name="other")  # fmt: skip
    procs.wait_for(other, "the trainer assigned shards", timeout=60)
    refusals = scrape(mport).by_label("lmpipe_trainer_handshake_refusals_total", "reason")
    # one per hello refused: the wrong producer may send a second before it reads the first answer
    n = refusals["config_mismatch"]
    assert n in (1, 2) and refusals == {
        "config_mismatch": n,
        "wire_version": 0,
        "worker_stopped": 0,
        "malformed": 0,
    }, refusals
    trainer.terminate()
    assert trainer.wait(timeout=60) == 0, procs.log(trainer)[-3000:]
    (summary,) = [ln for ln in procs.log(trainer).splitlines() if "summary:" in ln]
    assert summary.endswith(f"batches dropped: 0 malformed, 0 stale | refused: {n:.0f} producer hello(s)"), (
        "a producer with other settings sent nothing malformed"
    )
