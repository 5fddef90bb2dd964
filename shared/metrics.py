"""Prometheus metrics of every process: one class per role, each on its own registry and HTTP port.

Names follow Prometheus rules: `lmpipe_` prefix, base units (seconds, bytes), counters end in `_total`
(prometheus_client appends it), latencies are histograms. The Grafana dashboard and README read these
names; change them in all three places or not at all.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

log = logging.getLogger(__name__)

# step/data-wait latencies span ~1 ms (GPU step) to seconds (CPU step, starved trainer)
# Label values created up front, so every series exists (at 0) from the first scrape: dashboards and
# alerts then see "no problems" instead of "no data".
BAD_RECORD_REASONS = (
    "invalid_utf8", "line_too_long", "empty", "bad_json", "missing_text", "bad_ids", "bad_prompt", "bad_mask",
)  # fmt: skip
REJECT_REASONS = (
    "bad_header", "bad_version", "bad_kind", "bad_dtype", "bad_shape", "truncated", "bad_length",
    "bad_frames", "oversized", "bad_batch", "bad_worker", "bad_control", "handshake",
)  # fmt: skip
STALE_REASONS = ("old_session", "duplicate", "gap", "not_holder")
CACHES = ("causal_mask",)
GPU_MEMORY_KINDS = ("allocated", "reserved", "peak")


def _init_labels(metric, values) -> None:
    for v in values:
        metric.labels(v)


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serve(registry: CollectorRegistry, port: int | None, addr: str = "127.0.0.1") -> int | None:
    """Expose `registry` on http://addr:port/metrics; port 0 picks a free one. Returns the bound port.
    Loopback by default (--metrics-host): the numbers are not secret, but nobody else needs them."""
    if port is None or port < 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:  # a busy port must not stop training; say so and go on without
        log.warning("cannot serve metrics on %s:%d (%s); this process exports no metrics", addr, port, exc)
        return None
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", addr, bound)
    return bound


class ProducerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.info = Info("lmpipe_producer", "Producer identity and configuration", registry=r)
        self.documents = Counter("lmpipe_producer_documents", "Documents tokenized", registry=r)
        self.tokens = Counter(
            "lmpipe_producer_tokens", "Real tokens sent in batches", ["strategy"], registry=r
        )
        self.padding = Counter(
            "lmpipe_producer_padding_tokens", "Pad tokens sent in batches", ["strategy"], registry=r
        )
        self.batches = Counter("lmpipe_producer_batches_sent", "Batches sent to the trainer", registry=r)
        self.bad_records = Counter(
            "lmpipe_producer_bad_records", "Corpus records skipped", ["reason"], registry=r
        )
        self.tokenize = Histogram(
            "lmpipe_producer_tokenize_seconds",
            "Wall time of one encode_batch call (a chunk of documents)",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.send_blocked = Counter(
            "lmpipe_producer_send_blocked_seconds",
            "Time a ready batch waited for the trainer (backpressure)",
            registry=r,
        )
        self.connected = Gauge(
            "lmpipe_producer_connected", "1 while the trainer has welcomed this producer", registry=r
        )
        self.handshakes = Counter(
            "lmpipe_producer_handshakes", "Handshake answers by result", ["result"], registry=r
        )
        self.resets = Counter(
            "lmpipe_producer_stream_resets", "Stream restarts at a cursor the trainer sent", registry=r
        )
        self.cursor_pos = Gauge(
            "lmpipe_producer_cursor_position", "Document position of the last batch sent", registry=r
        )
        self.epoch = Gauge("lmpipe_producer_epoch", "Epoch of the last batch sent", registry=r)
        self.shards_held = Gauge(
            "lmpipe_producer_shards_held", "Shards of the corpus the trainer gave this producer", registry=r
        )
        _init_labels(self.bad_records, BAD_RECORD_REASONS)
        _init_labels(self.handshakes, ("welcome", "refuse"))


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # Plain totals beside the labelled counters, for the end-of-run summary (never read back from the registry)
        self.rejected_count = 0
        self.stale_count = 0
        self.info = Info("lmpipe_trainer", "Trainer identity and configuration", registry=r)
        self.tokens = Counter("lmpipe_trainer_tokens", "Real tokens trained on", registry=r)
        self.padding = Counter("lmpipe_trainer_padding_tokens", "Pad tokens in trained batches", registry=r)
        self.loss_tokens = Counter(  # below tokens by document ends, and by loss-masked tokens (fine-tuning)
            "lmpipe_trainer_loss_tokens", "Targets the loss was taken on", registry=r
        )
        self.steps = Counter(
            "lmpipe_trainer_steps", "Optimizer steps taken (including skipped ones)", registry=r
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
        self.data_wait = Histogram(
            "lmpipe_trainer_data_wait_seconds",
            "Time a step waited for a ready batch",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.h2d = Histogram(
            "lmpipe_trainer_h2d_seconds",
            "Host-to-device copy time of one batch",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.received = Counter(
            "lmpipe_trainer_batches_received", "Valid batches received", ["worker"], registry=r
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
            "Producers that left (connection closed, silent, or stopped); their shards go to the others",
            registry=r,
        )
        self.shards_per_producer = Gauge(
            "lmpipe_trainer_shards_per_producer",
            "Open shards held by the least (stat=min) and most (stat=max) loaded producer",
            ["stat"],
            registry=r,
        )
        self.shards_unserved = Gauge(
            "lmpipe_trainer_shards_unserved", "Open shards no producer holds (none connected)", registry=r
        )
        self.stream_resets = Counter(
            "lmpipe_trainer_stream_resets",
            "Requests to a producer to resend from its consumed cursor (a batch missing or rejected)",
            ["worker"],
            registry=r,
        )
        self.workers_failed = Gauge(
            "lmpipe_trainer_workers_failed",
            "Worker ids stopped for good: their batches were rejected every time they were sent",
            registry=r,
        )
        self.data_disconnects = Counter(
            "lmpipe_trainer_data_disconnects",
            "Data connections closed: producers that exited, or were cut off for a frame over the size guard",
            registry=r,
        )
        self.loss = Gauge("lmpipe_trainer_loss", "Training loss at the last logging interval", registry=r)
        self.lr = Gauge("lmpipe_trainer_learning_rate", "Learning rate", registry=r)
        self.grad_norm = Gauge("lmpipe_trainer_grad_norm", "Gradient norm before clipping", registry=r)
        self.loss_scale = Gauge(
            "lmpipe_trainer_loss_scale", "Current loss scale (1 when not scaling)", registry=r
        )
        self.overflows = Counter(
            "lmpipe_trainer_scaler_overflows", "Steps whose gradients had inf/NaN", registry=r
        )
        self.skipped = Counter(
            "lmpipe_trainer_skipped_steps", "Optimizer steps skipped by the loss scaler", registry=r
        )
        self.cache_hits = Counter("lmpipe_trainer_cache_hits", "Cache hits", ["cache"], registry=r)
        self.cache_misses = Counter("lmpipe_trainer_cache_misses", "Cache misses", ["cache"], registry=r)
        self.recompiles = Counter(
            "lmpipe_trainer_compile_recompiles", "torch.compile graph compilations", registry=r
        )
        self.gpu_memory = Gauge("lmpipe_trainer_gpu_memory_bytes", "GPU memory", ["kind"], registry=r)
        self.mfu = Gauge(
            "lmpipe_trainer_mfu_ratio", "Model FLOPs utilization against the card's bf16 peak", registry=r
        )
        self.checkpoints = Counter("lmpipe_trainer_checkpoints", "Checkpoints written", registry=r)
        self.loss_scale.set(1.0)
        _init_labels(self.rejected, REJECT_REASONS)
        _init_labels(self.stale, STALE_REASONS)
        _init_labels(self.cache_hits, CACHES)
        _init_labels(self.cache_misses, CACHES)
        _init_labels(self.gpu_memory, GPU_MEMORY_KINDS)
        _init_labels(self.shards_per_producer, ("min", "max"))
        self.checkpoint_seconds = Histogram(
            "lmpipe_trainer_checkpoint_seconds",
            "Time to write one checkpoint",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )

    def reject(self, reason: str) -> None:
        """A malformed message or refused handshake, dropped."""
        self.rejected.labels(reason).inc()
        self.rejected_count += 1

    def drop_stale(self, reason: str) -> None:
        """A valid batch that is not the next one to train on (old session, duplicate, gap...), dropped."""
        self.stale.labels(reason).inc()
        self.stale_count += 1
