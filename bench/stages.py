"""What the scaling and peers benchmarks share: producers with /metrics, snapshots of both sides' counters,
and a one-core profile of each stage of the data path.

A snapshot reads the in-process trainer's registry, each producer's /metrics over HTTP and each process's
CPU time from /proc; the difference of two snapshots is what happened in the window between them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lmpipe.consumer.report import thread_cpu_seconds

CLK = os.sysconf("SC_CLK_TCK")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def producer_env() -> dict[str, str]:
    """One core per producer: encode_batch runs on the calling thread (N producers use N cores), so that
    N producers against one is a measure of the pipeline, not of the tokenizer's thread pool."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    env.update(LMPIPE_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    return env


def start_producers(argv: list[str], ports: list[int]) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmpipe",
                "produce",
                *argv,
                "--worker",
                str(i),
                "--metrics-port",
                str(port),
            ],
            env=producer_env(),
        )
        for i, port in enumerate(ports)
    ]


def process_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK


def peak_rss(pid: int) -> int:
    """VmHWM of a process in bytes (its peak resident memory), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sums(families) -> dict[str, float]:
    """sample name -> value summed over its labels (histogram buckets left out)."""
    out: dict[str, float] = {}
    for fam in families:
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return sums(text_string_to_metric_families(r.read().decode()))
    except OSError:
        return {}  # not serving yet, or gone


@dataclass
class Snapshot:
    t: float
    trainer: dict[str, float]
    producers: list[dict[str, float]]
    producer_cpu: list[float]
    receive_cpu: float

    @classmethod
    def take(cls, trainer, procs: list[subprocess.Popen], ports: list[int]) -> Snapshot:
        return cls(
            time.perf_counter(),
            sums(trainer.metrics.registry.collect()),
            [scrape(p) for p in ports],
            [process_cpu(p.pid) for p in procs],
            thread_cpu_seconds(trainer.receiver.native_id) or 0.0,
        )


def window(a: Snapshot, b: Snapshot, n: int) -> dict[str, float]:
    """Rates and shares over the window between two snapshots, for n producers."""
    dt = b.t - a.t

    def tr(name: str) -> float:
        return b.trainer.get(name, 0.0) - a.trainer.get(name, 0.0)

    def pr(name: str) -> float:
        return sum(pb.get(name, 0.0) - pa.get(name, 0.0) for pa, pb in zip(a.producers, b.producers))

    batches = tr("lmpipe_trainer_batches_received_total")
    steps = tr("lmpipe_trainer_steps_total")
    cpu = sum(cb - ca for ca, cb in zip(a.producer_cpu, b.producer_cpu))
    tokenize = pr("lmpipe_producer_tokenize_seconds_sum")  # wall time of encode_batch calls
    blocked = pr("lmpipe_producer_send_blocked_seconds_total")
    return {
        "seconds": dt,
        "tokens_per_second": tr("lmpipe_trainer_tokens_total") / dt,
        "data_wait": tr("lmpipe_trainer_data_wait_seconds_sum") / dt,
        "producer_cpu": cpu / (n * dt),
        "tokenize": tokenize / (n * dt),
        "blocked": blocked / (n * dt),
        # read, shuffle, pack, encode, send, and waiting for a core on a busy machine
        "rest": max(n * dt - tokenize - blocked, 0.0) / (n * dt),
        "receive_busy": (b.receive_cpu - a.receive_cpu) / dt,
        "receive_ms": 1e3 * (b.receive_cpu - a.receive_cpu) / batches if batches else 0.0,
        "copy_ms": 1e3
        * tr("lmpipe_trainer_h2d_seconds_sum")
        / max(tr("lmpipe_trainer_h2d_seconds_count"), 1),
        "step_ms": 1e3 * tr("lmpipe_trainer_step_seconds_sum") / steps if steps else 0.0,
        "batches": batches,
    }


# -- one core, no sockets: the cost of each stage ---------------------------------------------------------


@dataclass
class MemStream:
    """Documents already tokenized, in memory: what the packer sees, without reading or tokenizing."""

    docs_: list
    tok: object
    worker: int = 0
    stats: object = field(default=None)

    def docs(self, epoch: int, start_pos: int = 0) -> Iterator:
        yield from self.docs_[start_pos:]


def stage_profile(
    text_files: list[str], shards: str, tok_path: str, seq_len: int, batch_size: int
) -> tuple[list, int, int]:
    """[stage, seconds per 1M tokens, microseconds per batch] for each stage of the path, on one core (the
    fastest of 3 runs); the corpus's token count; the number of batches.
    The trainer's side (decode and validate) is timed on the very frames a producer would send."""
    from lmpipe.producer.batching import BatchSpec, batches
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.batch import batch_from_message, batch_limits, token_dtype
    from lmpipe.shared.tokenizer import load_tokenizer
    from lmpipe.shared.wire import decode

    tok = load_tokenizer(tok_path)
    timings: dict[str, float] = {}

    def timed(name: str, fn, repeat: int = 3):
        """The fastest of `repeat` runs: other work on the machine only ever adds time."""
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        timings[name] = best
        return out

    texts = timed(
        "read text (split into documents)",
        lambda: [r.text for r in Corpus(text_files).records() if r.bad is None],
    )

    def encode() -> list:
        out = []
        for i in range(0, len(texts), 512):
            out += tok.tokenizer.encode_batch(texts[i : i + 512], add_special_tokens=False)
        return out

    encs = timed("tokenize (encode_batch, one thread)", encode)
    tokens = sum(len(e.ids) + 1 for e in encs)
    timed(
        "read shards (memory-mapped)",
        lambda: sum(len(d.ids) for d in DocStream(Corpus([shards]), tok).docs(0)),
    )
    docs = list(DocStream(Corpus([shards]), tok, shuffle_window=0).docs(0))
    spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=batch_size)
    dtype = token_dtype(tok.vocab_size)
    made = timed("pack into rows", lambda: list(batches(MemStream(docs, tok), spec, epochs=1, dtype=dtype)))  # type: ignore[arg-type]
    frames = timed("encode for the wire", lambda: [b.to_frames("s", 0, i, "l") for i, b in enumerate(made)])
    frames = [[bytes(f) if not isinstance(f, bytes) else f for f in fr] for fr in frames]  # as received
    limits = batch_limits(batch_size, seq_len)
    timed(
        "trainer: decode + validate",
        lambda: [batch_from_message(decode(f, limits), tok.vocab_size, seq_len, batch_size) for f in frames],
    )
    n = len(made)
    return [[name, 1e6 * s / tokens, 1e6 * s / n] for name, s in timings.items()], tokens, n


def one_core_ceiling(rows: list, names: list[str]) -> float:
    """Tokens/s one core reaches doing the named stages one after another."""
    per_m = sum(r[1] for r in rows if r[0] in names)
    return 1e6 / per_m if per_m else float("inf")
