"""What the trainer tells people: the end-of-run summary, the live status line, and MFU's denominator.

No torch here: lmpipe/progress.py imports this on hosts without it (the figures are counted in
consumer/runstats.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmpipe.consumer.slots import SlotMeta

# Dense bf16 peak FLOP/s by card name (substring of torch.cuda.get_device_name), for MFU; the benchmarks use
# the same table. H100/H200 SXM: 989 TFLOP/s.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12}


def peak_flops(device_name: str) -> float:
    """The card's dense bf16 peak, 0.0 where unknown (MFU then stays 0)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), 0.0)


@dataclass
class Summary:
    steps: int = 0  # the step the run ended at (a resumed run's count goes on from its checkpoint's)
    first_step: int = 0  # the step it started at: 0, or the resumed checkpoint's
    tokens: int = 0  # real (non-pad) tokens in trained batches: what throughput is measured in
    pad_tokens: int = 0
    targets: int = 0  # targets the loss was taken on: tokens minus document ends and loss-masked tokens
    # steps whose batches held no trained target (all loss-masked): no forward, backward or update, since
    # AdamW would still move the weights on a zero gradient (momentum, weight decay)
    untrained_steps: int = 0
    seconds: float = 0.0  # from the first batch to the end
    data_wait_seconds: float = 0.0  # waits for data within `seconds`, the last one (no batch came) included
    # the wait for the first batch, apart: start-up, producers started late, storage down from the start
    first_data_wait_seconds: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    losses: list[float] = field(default_factory=list)
    # one entry per logging interval: step, elapsed, loss, lr, tokens_per_second, data_wait (`lmpipe plot`)
    history: list[dict] = field(default_factory=list)
    eval_loss: float = float("nan")  # on the held-out --eval-data batches, at the last evaluation
    evals: list[dict] = field(default_factory=list)  # one entry per evaluation: step, eval_loss
    rejected: int = 0
    stale: int = 0
    refused: int = 0  # hellos turned away for good (other settings, a worker id out of range...)
    # bad corpus records (and bad lines inside kept text documents) the producers skipped, by reason, in what
    # they read: each shard's highest count (receiver.SkippedRecords); producers read ahead of training
    skipped: dict[str, int] = field(default_factory=dict)
    compiled_graphs: int = 0
    stopped_by: str = ""
    # Honest throughput: the first logging interval holds compilation and warm-up, so steady state is
    # measured from its end to the end of the run; time to first step (start-up, waiting for producers,
    # compilation) is reported on its own.
    time_to_first_step: float = float("nan")
    # from the process's start to the end of the first step: total, startup (imports, model, checkpoint,
    # sockets), compile (the compile cache, the compile ahead and the first step), first_batch_wait (after the
    # compile), first_step (uncompiled: the step itself), compiled_ahead, compile_cache (consumer/startup.py)
    first_step_split: dict = field(default_factory=dict)
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    steady_mfu: float | None = None  # None: no steady state, or no known peak (CPU, an unlisted GPU)
    # --consume-only: where the trainer's time went, per batch consumed (see consumer/runstats.py)
    consume: dict[str, float] = field(default_factory=dict)
    # a mixture's realized mixture: per source, tokens trained, share, target share (the weight at the end)
    # and epoch, over the whole run (resumes included); {} without a mixture
    mixture: dict[str, dict] = field(default_factory=dict)
    # the trainer ranks and rank 0's shards (consumer/reshard.py): world_size, shards, shard_space, and where
    # the run resumed, resumed_step and resumed_world_size (the checkpoint's ranks)
    topology: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_tokens_per_second(self) -> float | None:
        """None when no step ran after the first logging interval: a run that short has no steady state,
        and its overall figure is mostly start-up."""
        return (
            self.steady_tokens / self.steady_seconds
            if self.steady_tokens and self.steady_seconds > 0
            else None
        )

    @property
    def padding_efficiency(self) -> float:
        total = self.tokens + self.pad_tokens
        return self.tokens / total if total else 0.0

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.seconds if self.seconds > 0 else 0.0

    def _render_resized(self) -> str:
        was, now = self.topology.get("resumed_world_size"), self.topology.get("world_size")
        out = f", from {was} rank{'s' if was != 1 else ''} on {now}" if was and now and was != now else ""
        n = self.topology.get("restarts")
        return out + (f", after torchrun's restart {n}" if n else "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_second=self.tokens_per_second,
            steady_tokens_per_second=self.steady_tokens_per_second,
            padding_efficiency=self.padding_efficiency,
            data_wait_fraction=self.data_wait_fraction,
        )
        return d

    def render(self) -> str:
        if self.steps <= self.first_step:
            return (
                f"summary: no steps trained in {self.seconds:.1f} s ({self.stopped_by or 'stopped'}"
                + (
                    f", {self.first_data_wait_seconds:.1f} s waiting for data"
                    if self.first_data_wait_seconds >= 0.05
                    else ""
                )
                + ") | "
                f"batches dropped: {self.rejected} malformed, {self.stale} stale"
                + (f" | refused: {self.refused} producer hello(s)" if self.refused else "")
                + self._render_skipped()
            )
        return (
            f"summary: {self.steps - self.first_step} step{'s' if self.steps - self.first_step != 1 else ''}"
            + (
                f" (steps {self.first_step + 1}-{self.steps}: resumed at {self.first_step}{self._render_resized()})"
                if self.first_step
                else ""
            )
            + f" in {self.seconds:.1f} s ({self.stopped_by}) | "
            + (  # one logged interval: one loss, not a change of it
                f"loss {self.first_loss:.3f} -> {self.last_loss:.3f} | "
                if len(self.losses) > 1
                else f"loss {self.last_loss:.3f} (one --log-every interval) | "
            )
            + (f"eval loss {self.eval_loss:.3f} (step {self.evals[-1]['step']}) | " if self.evals else "")
            + f"{self.tokens:,} tokens trained ({self.targets:,} in the loss), "
            + (
                f"{self.steady_tokens_per_second:,.0f} tok/s steady"
                if self.steady_tokens_per_second is not None
                else "no steady tok/s (no step after the first --log-every interval)"
            )
            + (f", MFU {100 * self.steady_mfu:.1f}%" if self.steady_mfu else "")
            + f" ({self.tokens_per_second:,.0f} overall, {self._render_first_step()}) | "
            + f"padding efficiency {100 * self.padding_efficiency:.1f}% | "
            f"data wait {100 * self.data_wait_fraction:.1f}% | "
            f"batches dropped: {self.rejected} malformed, {self.stale} stale"
            + (f" | refused: {self.refused} producer hello(s)" if self.refused else "")
            + self._render_skipped()
            + (
                f" | {self.untrained_steps} steps without a trained target (no update)"
                if self.untrained_steps
                else ""
            )
            + (self._render_consume() if self.consume else "")
            + self._render_mixture()
        )

    def _render_first_step(self) -> str:
        sp = self.first_step_split
        if not sp:
            return f"first step after {self.time_to_first_step:.1f} s" + (
                f" ({self.first_data_wait_seconds:.1f} s waiting for data)"
                if self.first_data_wait_seconds >= 0.05
                else ""
            )
        cache = f", cache {sp['compile_cache']}" if sp.get("compile_cache", "off") != "off" else ""
        # uncompiled: the first step's own time where the compile's would be
        work = f"compile {sp['compile']:.1f} s{cache}" if sp["compile"] else f"step {sp['first_step']:.1f} s"
        return (
            f"first step {sp['total']:.1f} s after start (start-up {sp['startup']:.1f} s, {work}, "
            f"{sp['first_batch_wait']:.1f} s waiting for data)"
        )

    def _render_mixture(self) -> str:
        if not self.mixture:
            return ""
        each = ", ".join(
            f"{name} {100 * s['share']:.1f}% (target {100 * s['target']:.1f}%, epoch {s['epoch']})"
            for name, s in self.mixture.items()
        )
        return f" | mixture, tokens trained: {each}"

    def _render_skipped(self) -> str:
        if not self.skipped:
            return ""
        by = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.skipped.items()))
        return f" | bad input skipped: {sum(self.skipped.values()):,} ({by})"

    def _render_consume(self) -> str:
        c = self.consume
        receive = (
            f"receive + decode + validate {1e3 * c['receive_seconds_per_batch']:.3f} ms "
            f"(receive thread busy {100 * c['receive_busy']:.0f}% of a core), "
            if "receive_seconds_per_batch" in c
            else ""
        )
        ranks = int(c.get("ranks", 1))
        return (
            f"\nconsume only (no model): {c['batches']:,.0f} batches; per batch"
            + (f" (rank 0 of {ranks})" if ranks > 1 else "")
            + f": {receive}"
            f"copy to the device {1e3 * c['copy_seconds_per_batch']:.3f} ms, "
            f"data wait {1e3 * c['wait_seconds_per_batch']:.3f} ms"
        )


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """CPU time of one thread of this process (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    s = int(max(0.0, seconds) + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_loss(loss: float) -> str:
    """NaN: the interval had no trained target, so there is no loss to show (0 would read as perfect)."""
    return "n/a" if math.isnan(loss) else f"{loss:.4f}"


def status_fields(
    step: int, stats: dict, total: int, eta: float | None = None, live: bool = False
) -> list[tuple[int, str]]:
    """The status line's fields in order, each with its rank: a narrow terminal drops the highest ranks
    first (lmpipe/live.py). `eta`: the time left (None: at the last interval's pace, if known); `live`: the
    line between logging intervals, whose figures may not have come yet."""
    fields = [(0, f"step {step}{f'/{total}' if total else ''}")]
    if "loss" in stats or not live:
        fields += [
            (1, f"loss {format_loss(stats['loss'])}"),
            (5, f"lr {stats['lr']:.2e}"),
            (2, f"{stats['tokens_per_second']:,.0f} tok/s"),
            (3, f"data wait {100 * stats['data_wait']:.1f}%"),
            (6, f"pad eff {100 * stats['padding_efficiency']:.1f}%"),
        ]
        if stats.get("loss_scale", 1.0) != 1.0:
            fields.append((4, f"scale {stats['loss_scale']:.0f}"))
        if stats.get("mfu"):
            fields.append((4, f"MFU {100 * stats['mfu']:.1f}%"))
    if "elapsed" in stats:
        if eta is None and total and step < total and stats.get("step_seconds"):
            eta = (total - step) * stats["step_seconds"]
        left = f", ETA {duration(eta)}" if eta is not None and total and step < total else ""
        fields.append((0, f"{duration(stats['elapsed'])}{left}"))
    return fields


def print_status(step: int, stats: dict, total: int, stream=sys.stderr, eta: float | None = None) -> None:
    """The status line, one line per logging interval, for a log file or a pipe (on a terminal the CLI draws
    lmpipe/live.py's line instead). With a step limit, the time left: `eta`, or at the last interval's pace."""
    stream.write(" | ".join(text for _, text in status_fields(step, stats, total, eta)) + "\n")
    stream.flush()


class Announce:
    """A long blocking call made visible: a log line when it starts, one every `every` seconds while it
    lasts (a compiling trainer is not a hung one), and one with its duration at the end."""

    def __init__(self, what: str, log: logging.Logger, every: float = 30.0):
        self.what, self.log, self.every = what, log, every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="announce", daemon=True)

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            self.log.info("%s... %s so far", self.what, duration(time.monotonic() - self.start))

    def __enter__(self) -> Announce:
        self.start = time.monotonic()
        self.log.info("%s...", self.what)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        if exc[0] is None:
            self.log.info("%s: done in %s", self.what, duration(time.monotonic() - self.start))


class DocLog:
    """--doc-log: one JSON line per step naming the document pieces of each of its batches (shard, sequence
    number, session), so that a run can be checked to have trained each document exactly once."""

    def __init__(self, path: str):
        self.path = path
        self._failed = False
        self._file = open(path, "a")  # noqa: SIM115 - closed by close()

    def _said(self, exc: OSError) -> OSError:
        """A write that failed (a full disk) as one line naming the file; close() then says nothing more."""
        self._failed = True
        return OSError(f"--doc-log {self.path}: cannot write it ({exc.strerror or exc})")

    def write(self, step: int, metas: list[SlotMeta]) -> None:
        rows = []
        for m in metas:
            if m.parts is not None:  # a mixture's batch: an entry per run of rows of one received batch
                rows += _parts(m)
                continue
            pieces = [[int(a), int(b), int(c)] for a, b, c in zip(m.doc_id, m.doc_start, m.doc_len)]
            rows.append(
                {
                    "shard": m.shard,
                    "seq": m.seq,
                    "session": m.session,
                    "docs": pieces,
                    "targets": m.n_targets,
                }
            )
        try:
            self._file.write(json.dumps({"step": step, "batches": rows}) + "\n")
            self._file.flush()
        except OSError as exc:
            raise self._said(exc) from None

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as exc:
            if not self._failed:  # else the first failure is said already; the rest was never written
                raise self._said(exc) from None


def _parts(m: SlotMeta) -> list[dict]:
    """A mixture's assembled batch in the doc log: per run of rows of one received batch, its source."""
    out = []
    for p in m.parts or ():
        a, b = p.pieces
        pieces = [
            [int(x), int(y), int(z)] for x, y, z in zip(m.doc_id[a:b], m.doc_start[a:b], m.doc_len[a:b])
        ]
        out.append({"shard": p.shard, "seq": p.seq, "session": p.session, "source": p.source, "docs": pieces,
                    "targets": p.targets})  # fmt: skip
    return out
