"""Prometheus metrics of every process: one class per role, each on its own registry and HTTP port (the
producer's in shared/metrics_producer.py).

Names follow Prometheus rules: `lmpipe_` prefix, base units (seconds, bytes), counters end in `_total`
(prometheus_client appends it), latencies are histograms. The Grafana dashboard, the alert rules
(deploy/prometheus/lmpipe.rules.yml) and the README read these names; change them everywhere or not at all.

Metrics never lie: a gauge with no reading yet is NaN (Prometheus and Grafana show "no value"), never a
0 that reads as a measurement; label values are short snake_case codes or ids, never prose; counters
have no `_created` twin series.
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from lmpipe.shared import __version__
from lmpipe.shared.metrics_http import MetricsServer, raise_open_files_limit

log = logging.getLogger(__name__)

# `_created` doubles every counter and histogram series for a timestamp nobody queries (process start is
# `process_start_time_seconds`, and resets show in rate()).
prometheus_client.disable_created_metrics()

NAN = math.nan
# Label values created up front, so every series exists (at 0) from the first scrape: dashboards and
# alerts then see "no problems" instead of "no data".
BAD_RECORD_REASONS = (
    "invalid_utf8", "binary", "line_too_long", "empty", "bad_json", "missing_text", "bad_ids", "bad_prompt",
    "bad_mask", "damaged",
)  # fmt: skip
REJECT_REASONS = (
    "bad_header", "bad_version", "bad_kind", "bad_dtype", "bad_shape", "truncated", "bad_length",
    "bad_frames", "oversized", "bad_batch", "bad_worker", "bad_control", "handshake",
)  # fmt: skip
STALE_REASONS = ("old_session", "duplicate", "gap", "not_holder")
LEAVE_REASONS = ("bye", "closed", "silent", "stopped")  # lmpipe_trainer_producer_leaves_total{reason}
# Why the trainer turned a producer's hello away; each makes the producer exit 2 (nothing is retried). Since
# the trainer assigns shards, no worker id can be taken or held: `bad_worker_id` and `busy` are gone.
REFUSAL_REASONS = ("config_mismatch", "wire_version", "worker_stopped", "malformed")
HANDSHAKE_RESULTS = ("welcome", "refuse")
CACHES = ("causal_mask",)
GPU_MEMORY_KINDS = ("allocated", "reserved", "peak")


def init_labels(metric, values) -> None:
    for v in values:
        metric.labels(v)


# Step, data-wait and checkpoint times span ~1 ms (a GPU step) to minutes (a CPU step of a small model
# takes 5-20 s on 2 cores, a GPT-2 checkpoint several seconds, a starved trainer waits as long as it must).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip


def short_hash(text: str) -> str:
    """A 12-hex-digit id for a long value (a corpus description) that must not go into a label as prose."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build_info(registry: CollectorRegistry, role: str) -> Info:
    """`lmpipe_build_info{version, python, role} 1` on every process: which lmpipe answers at a target.
    With it, the standard process_* series (start time, CPU seconds, memory, open files)."""
    ProcessCollector(registry=registry)
    info = Info("lmpipe_build", "lmpipe version of this process", registry=registry)
    info.info({"version": __version__, "python": platform.python_version(), "role": role})
    return info


_SERVERS: list[MetricsServer] = []  # serving until the process exits


def serve(registry: CollectorRegistry, port: int | None, addr: str = "127.0.0.1") -> int | None:
    """Expose `registry` on http://addr:port/metrics; port 0 picks a free one. Returns the bound port.
    Loopback by default (--metrics-host): the numbers are not secret, but nobody else needs them. The
    server is bounded (shared/metrics_http.py): whatever connects, it costs this process a few descriptors."""
    if port is None or port < 0:
        return None
    raise_open_files_limit()
    try:
        server = MetricsServer(lambda: generate_latest(registry), CONTENT_TYPE_LATEST, port, addr)
    except OSError as exc:  # a busy port must not stop training; say so and go on without
        # `lmpipe health` checks who holds the port, so a squatter's figures are not taken for ours
        log.warning("cannot serve metrics on %s:%d (%s); this process exports no metrics", addr, port, exc)
        return None
    _SERVERS.append(server)
    log.info("metrics on http://%s:%d/metrics", addr, server.port)
    return server.port


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # Plain totals beside the labelled counters, for the end-of-run summary (never read back from the registry)
        self.rejected_count = 0
        self.stale_count = 0
        self.refused_count = 0
        self.build = build_info(r, "trainer")
        self.info = Info("lmpipe_trainer", "Trainer identity and configuration", registry=r)
        # one method per group of families: a new metric goes into its group
        self._training(r)
        self._data(r)
        self._producers(r)
        self._optimizer(r)
        self._checkpoints(r)
        self._topology(r)
        self._start_values()

    def _training(self, r: CollectorRegistry) -> None:
        """Progress and speed: tokens, steps, their timing."""
        self.tokens = Counter("lmpipe_trainer_tokens", "Real tokens trained on", registry=r)
        self.padding = Counter("lmpipe_trainer_padding_tokens", "Pad tokens in trained batches", registry=r)
        self.loss_tokens = Counter(  # below tokens by document ends, and by loss-masked tokens (fine-tuning)
            "lmpipe_trainer_loss_tokens", "Targets the loss was taken on", registry=r
        )
        self.steps = Counter(
            "lmpipe_trainer_steps",
            "Optimizer steps taken by this process (including skipped ones); starts at 0 on resume",
            registry=r,
        )
        self.last_step_time = Gauge(
            "lmpipe_trainer_last_step_timestamp_seconds",
            "Unix time of this process's latest step (NaN before its first); `lmpipe health` reads it",
            registry=r,
        )
        self.global_step = Gauge(
            "lmpipe_trainer_global_step",
            "The run's step: the checkpoint's at start (0 fresh), then +1 per step; survives resume",
            registry=r,
        )
        self.first_step_seconds = Gauge(
            "lmpipe_trainer_time_to_first_step_seconds",
            "From the trainer's start to the end of its first step (start-up, first batch, compilation)",
            registry=r,
        )
        self.step_seconds = Histogram(
            "lmpipe_trainer_step_seconds",
            "Wall time of one optimizer step",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.mfu = Gauge(
            "lmpipe_trainer_mfu_ratio",
            "Model FLOPs utilization against the card's bf16 peak (NaN where the peak is unknown, and on CPU)",
            registry=r,
        )
        self.recompiles = Counter(
            "lmpipe_trainer_compile_recompiles", "torch.compile graph compilations", registry=r
        )
        self.cache_hits = Counter("lmpipe_trainer_cache_hits", "Cache hits", ["cache"], registry=r)
        self.cache_misses = Counter("lmpipe_trainer_cache_misses", "Cache misses", ["cache"], registry=r)
        self.gpu_memory = Gauge(
            "lmpipe_trainer_gpu_memory_bytes",
            "GPU memory (NaN on CPU and before a reading)",
            ["kind"],
            registry=r,
        )

    def _data(self, r: CollectorRegistry) -> None:
        """Batches coming in: waits, copies, and what was dropped."""
        self.data_wait = Histogram(
            "lmpipe_trainer_data_wait_seconds",
            "Time a step waited for a ready batch",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        # Counted while the wait lasts, not when a step ends: its rate is the share of wall time spent
        # waiting, 1 for a trainer starved of every batch (where the histogram, observed per step, stands
        # still and a ratio over the step time is 0/0).
        self.data_waiting = Counter(
            "lmpipe_trainer_data_waiting_seconds",
            "Time the step loop has waited for batches, counted as it waits",
            registry=r,
        )
        self.h2d = Histogram(
            "lmpipe_trainer_h2d_seconds",
            "Host-to-device copy time of one batch",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.received = Counter(
            "lmpipe_trainer_batches_received", "Valid batches received, by shard", ["shard"], registry=r
        )
        self.rejected = Counter(
            "lmpipe_trainer_batches_rejected", "Messages dropped as malformed", ["reason"], registry=r
        )
        self.stale = Counter(
            "lmpipe_trainer_stale_batches",
            "Batches dropped as already consumed, from an old session, or not from the worker id's holder",
            ["reason"],
            registry=r,
        )
        self.ready_slots = Gauge(
            "lmpipe_trainer_ready_slots", "Filled host slots waiting for the step loop", registry=r
        )
        # a mixture's sources (label `source`: its name), series created when the mixture starts
        src = ["source"]
        self.source_tokens = Counter("lmpipe_trainer_source_tokens", "Real tokens trained per source", src,
                                     registry=r)  # fmt: skip
        self.source_share = Gauge("lmpipe_trainer_source_share", "Realized share of the tokens trained, per "
                                  "source, since the run began (resumes included)", src, registry=r)  # fmt: skip
        self.source_target_share = Gauge("lmpipe_trainer_source_target_share", "The mixture's weight of each "
                                         "source at this step (normalized)", src, registry=r)  # fmt: skip
        self.source_epoch = Gauge("lmpipe_trainer_source_epoch", "Each source's epoch: the least among its "
                                  "shards", src, registry=r)  # fmt: skip

    def _topology(self, r: CollectorRegistry) -> None:
        """The trainer's ranks and this rank's share (consumer/reshard.py); the resumed ones NaN when fresh."""
        self.world_size = Gauge("lmpipe_trainer_world_size", "Trainer ranks (torchrun)", registry=r)
        self.rank_shards = Gauge("lmpipe_trainer_rank_shards", "Shards this rank trains, per source", registry=r)  # fmt: skip
        self.resumed_step = Gauge("lmpipe_trainer_resumed_step", "The step this run resumed from", registry=r)
        self.resumed_world_size = Gauge("lmpipe_trainer_resumed_world_size", "The checkpoint's ranks", registry=r)  # fmt: skip
        self.restarts = Gauge("lmpipe_trainer_restarts", "Times torchrun's agent restarted this rank's workers "
                              "(TORCHELASTIC_RESTART_COUNT: after a lost rank, each resumes)", registry=r)  # fmt: skip

    def _producers(self, r: CollectorRegistry) -> None:
        """Producers joining and leaving, and the shards they hold."""
        self.producers = Gauge(
            "lmpipe_trainer_producers_connected", "Producers heard from in the last 5 s", registry=r
        )
        self.producer_joins = Counter(
            "lmpipe_trainer_producer_joins",
            "Producers that joined (each takes shards or stands by)",
            registry=r,
        )
        self.producer_leaves = Counter(
            "lmpipe_trainer_producer_leaves",
            "Producers that left, by reason: bye (it said so: stopped or scaled down), closed (its connection "
            "closed without a bye: killed, crashed, host gone), silent (no hello for 40 s), stopped (the "
            "trainer stopped it); their shards go to the others",
            ["reason"],
            registry=r,
        )
        for reason in LEAVE_REASONS:  # 0 before the first: `increase` sees the first leave
            self.producer_leaves.labels(reason)
        self.shards_per_producer = Gauge(
            "lmpipe_trainer_shards_per_producer",
            "Open shards held by the least (stat=min) and most (stat=max) loaded producer",
            ["stat"],
            registry=r,
        )
        self.shards_unserved = Gauge(
            "lmpipe_trainer_shards_unserved", "Open shards no producer holds (none connected)", registry=r
        )
        self.producers_expected = Gauge(
            "lmpipe_trainer_producers_expected",
            "Producers this trainer waits for before its first assignment (--producers)",
            registry=r,
        )
        self.stream_resets = Counter(
            "lmpipe_trainer_stream_resets",
            "Requests to a producer to resend from its consumed cursor (a batch missing or rejected), by shard",
            ["shard"],
            registry=r,
        )
        self.shards_failed = Gauge(
            "lmpipe_trainer_shards_failed",
            "Shards stopped for good: their batches were rejected every time they were sent",
            registry=r,
        )
        self.data_disconnects = Counter(
            "lmpipe_trainer_data_disconnects",
            "Data connections closed: producers that exited, or were cut off for a frame over the size guard",
            registry=r,
        )
        self.refusals = Counter(
            "lmpipe_trainer_handshake_refusals",
            "Hellos turned away, by reason (each makes the producer exit)",
            ["reason"],
            registry=r,
        )

    def _optimizer(self, r: CollectorRegistry) -> None:
        """The model's training: loss, learning rate, gradients, loss scaling."""
        self.loss = Gauge(
            "lmpipe_trainer_loss", "Training loss at the last logging interval (NaN before it)", registry=r
        )
        self.eval_loss = Gauge(
            "lmpipe_trainer_eval_loss",
            "Loss on the held-out --eval-data batches at the last evaluation (NaN before it)",
            registry=r,
        )
        self.lr = Gauge(
            "lmpipe_trainer_learning_rate", "Learning rate (NaN before the first step)", registry=r
        )
        self.grad_norm = Gauge(
            "lmpipe_trainer_grad_norm",
            "Gradient norm before clipping, at the last logging interval (NaN before it)",
            registry=r,
        )
        self.loss_scale = Gauge(
            "lmpipe_trainer_loss_scale", "Current loss scale (1 when not scaling)", registry=r
        )
        self.overflows = Counter(
            "lmpipe_trainer_scaler_overflows", "Steps whose gradients had inf/NaN", registry=r
        )
        self.skipped = Counter(
            "lmpipe_trainer_skipped_steps", "Optimizer steps skipped by the loss scaler", registry=r
        )

    def _checkpoints(self, r: CollectorRegistry) -> None:
        self.checkpoints = Counter("lmpipe_trainer_checkpoints", "Checkpoints written", registry=r)
        self.checkpoint_time = Gauge(
            "lmpipe_trainer_checkpoint_timestamp_seconds",
            "Unix time of the latest checkpoint written, or resumed from (NaN before either)",
            registry=r,
        )
        self.checkpoint_step = Gauge(
            "lmpipe_trainer_checkpoint_step",
            "Step of the latest checkpoint written, or resumed from (NaN before either)",
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "lmpipe_trainer_checkpoint_seconds",
            "Time to write one checkpoint",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.checkpoint_blocked_seconds = Histogram(
            "lmpipe_trainer_checkpoint_blocked_seconds",
            "Time the step loop stopped for one checkpoint: the whole write (sync), or the copy of the state "
            "to host memory and any wait for the previous write (async)",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )

    def _start_values(self) -> None:
        """NaN for what has no reading yet; every labelled series created at 0 (module docstring)."""
        self.loss_scale.set(1.0)
        for g in (self.loss, self.lr, self.grad_norm, self.mfu, self.first_step_seconds, self.checkpoint_time,
                  self.checkpoint_step, self.last_step_time, self.resumed_step,
                  self.resumed_world_size):  # fmt: skip
            g.set(NAN)
        self.global_step.set(0)
        init_labels(self.refusals, REFUSAL_REASONS)
        init_labels(self.rejected, REJECT_REASONS)
        init_labels(self.stale, STALE_REASONS)
        init_labels(self.cache_hits, CACHES)
        init_labels(self.cache_misses, CACHES)
        init_labels(self.gpu_memory, GPU_MEMORY_KINDS)
        init_labels(self.shards_per_producer, ("min", "max"))
        for kind in GPU_MEMORY_KINDS:
            self.gpu_memory.labels(kind).set(NAN)

    def reject(self, reason: str) -> None:
        """A malformed message or refused handshake, dropped."""
        self.rejected.labels(reason).inc()
        self.rejected_count += 1

    def refuse(self, reason: str) -> None:
        """A hello turned away; `reason` is one of REFUSAL_REASONS. It also counts among rejected messages
        (reason `handshake`), but the summary tells refusals apart from malformed messages: a producer with
        other settings sent nothing broken."""
        self.refusals.labels(reason).inc()
        self.rejected.labels("handshake").inc()
        self.refused_count += 1

    def checkpointed(self, step: int, unix_time: float) -> None:
        self.checkpoint_step.set(step)
        self.checkpoint_time.set(unix_time)

    def drop_stale(self, reason: str) -> None:
        """A valid batch that is not the next one to train on (old session, duplicate, gap...), dropped."""
        self.stale.labels(reason).inc()
        self.stale_count += 1
