"""The trainer's bookkeeping around its loop: what each step adds (tokens, targets, padding, data wait, the
loss on the device), what each logging interval reports (metrics, the log line or progress call, a history
row), and the end-of-run summary. The loss is read from the device once per interval, never per step, and
then one step late (REPORT_BEHIND).

Apart from consumer/report.py (the summary and status line themselves), which stays importable without torch:
lmpipe/progress.py uses it on hosts without it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmpipe.consumer.report import Summary, format_loss, peak_flops, thread_cpu_seconds

if TYPE_CHECKING:
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.distributed import Dist
    from lmpipe.consumer.feed import DeviceFeed
    from lmpipe.consumer.scaler import LossScaler
    from lmpipe.consumer.sinks import Sinks
    from lmpipe.consumer.slots import SlotMeta
    from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")

Progress = Callable[[int, dict], None]

# An interval's loss and grad norm are copied to pinned host memory behind an event when it closes, and read
# after the next step is queued: the read waits for the interval's last step alone, while the GPU runs the
# next. Read at once (False), the sync drains the GPU's queue, and it idles while the host prepares the next
# step: 2-3 ms per interval under CUDA graphs (bench/results/kernels-*.md; bench.ablation's row).
REPORT_BEHIND = True


@dataclass
class _Closed:
    """A closed logging interval whose device values are on their way to the host."""

    step: int
    lr: float
    # on the host: the interval's summed loss, its last step's grad norm, and with a loss scaler its scale,
    # overflows and skipped steps so far
    values: torch.Tensor
    done: torch.cuda.Event | None  # a timing event: the steady-state clock may start at it
    targets: int
    tokens: int
    wait: float
    tokens_so_far: int  # the run's tokens when it closed: the steady-state clock starts there
    progress: Progress | None


class CompiledGraphs:
    """torch.compile graphs compiled since this trainer was built: dynamo's counter is per process, and the
    benchmarks build several trainers in one."""

    def __init__(self) -> None:
        self._at_start = self._seen = self._now()

    @staticmethod
    def _now() -> int:
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    @property
    def total(self) -> int:
        return self._seen - self._at_start

    def count(self, metrics: TrainerMetrics) -> None:
        graphs = self._now()
        if graphs > self._seen:
            metrics.recompiles.inc(graphs - self._seen)
            if self._seen > self._at_start:
                log.info("torch.compile: %d graph(s) compiled so far", graphs - self._at_start)
            self._seen = graphs


class TrainingDiverged(ValueError):
    """The loss is NaN or inf: the weights or activations overflowed, and every later step repeats it. A
    ValueError, so that the CLI says it in one line and exits 2, like the other refusals."""


def _check_finite(loss_sum: float, targets: float, first: int, last: int) -> None:
    """TrainingDiverged if steps first..last trained targets to a loss that is not finite."""
    if not targets or math.isfinite(loss_sum):
        return
    steps = f"step {last}" if first >= last else f"steps {first}-{last}"
    raise TrainingDiverged(
        f"training diverged: the loss over {steps} is {loss_sum / targets} (not finite); stopping, with no "
        "checkpoint written of this state: try a lower --lr or a longer --warmup (--resume from an earlier "
        "checkpoint keeps the steps before it)"
    )


def untrained_reason(loss_masked: bool) -> str:
    """Why a step's batches hold no trained target. Plain text has no loss mask: there every piece in the
    batches is a single token (a document's last token, or the end of one cut into rows, which bucket
    batches together), and a piece's last token has no next one to predict."""
    if loss_masked:
        return "every token loss-masked"
    return "every document piece in them is a single token, with no next token in its document to predict"


class RunStats:
    """One run's counts: per step (add_step), per logging interval (close_interval) and for the summary
    (finish). `published`: the loss scaler's overflow/skip counts already in the metrics (a resumed run's)."""

    def __init__(
        self,
        cfg: TrainConfig,
        dist: Dist,
        metrics: TrainerMetrics,
        feed: DeviceFeed,
        device: torch.device,
        scaler: LossScaler | None,
        published: tuple[float, float],
        flops_per_token: float,
        trained: bool,
        started: float,
        step: int,
    ):
        self.cfg, self.dist, self.metrics, self.feed, self.device = cfg, dist, metrics, feed, device
        self.scaler, self.published, self.flops_per_token = scaler, published, flops_per_token
        self.trained, self.started = trained, started  # trained: False with --consume-only
        self.summary = Summary(first_step=step)  # a resumed run starts at its checkpoint's step
        self.batches = 0
        self.run_start: float | None = None
        # the interval so far
        self._loss = torch.zeros((), device=device)
        self._targets = self._tokens = 0
        self._wait = 0.0
        self._lr = math.nan  # the last step's learning rate (the summary's last history row)
        self._unobserved = 0.0  # the wait for the first batch, until the first step puts it in the metric
        self._start: float | None = None
        self._step = step
        self._steady: tuple[float, int] | None = None  # (time, tokens) at the end of the first interval
        self._closed: _Closed | None = None  # an interval closed and not yet reported (REPORT_BEHIND)
        # where its values land: one buffer, as an interval is reported before the next closes. Pinned once
        # here: cudaHostAlloc can wait for the device, a copy into pinned memory does not
        self._host = torch.empty(5, pin_memory=True) if device.type == "cuda" else None
        self._steady_event: torch.cuda.Event | None = None  # the device's end of the first interval
        self.sinks: Sinks | None = None  # --log-to (rank 0's; the trainer sets it)

    @property
    def first(self) -> bool:
        """No step taken yet (torch.compile compiles in the first)."""
        return math.isnan(self.summary.time_to_first_step)

    def start_clock(self, waited: float) -> float:
        """The clock starts with the first batch, not with the producers' start-up: the wait for that batch
        is counted apart (Summary.first_data_wait_seconds), not in the run's data wait (0.0 then)."""
        if self.run_start is not None:
            return waited
        self.run_start = self._start = time.perf_counter()
        self.summary.first_data_wait_seconds += waited
        self._unobserved += waited  # the metric counts it with the first step
        return 0.0

    def waited_for_nothing(self, waited: float) -> None:
        """A wait that ended with no batch (the end of the data, a stop, --wait-timeout): still waited."""
        if self.run_start is None:
            self.summary.first_data_wait_seconds += waited
        else:
            self.summary.data_wait_seconds += waited
            self._wait += waited
        self.metrics.data_wait.observe(waited)

    def first_step_done(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once: the first step's real end
        self.summary.time_to_first_step = time.perf_counter() - self.started
        self.metrics.first_step_seconds.set(self.summary.time_to_first_step)

    def add_step(self, metas: list[SlotMeta], loss_sum: torch.Tensor, waited: float, lr: float) -> None:
        s, m = self.summary, self.metrics
        real = sum(x.real_tokens for x in metas)
        n_targets = sum(x.n_targets for x in metas)
        pad = sum(x.pad_tokens for x in metas)
        self.batches += len(metas)
        self._loss += loss_sum
        self._targets += n_targets
        self._tokens += real
        self._wait += waited
        s.tokens += real
        s.targets += n_targets
        s.pad_tokens += pad
        s.data_wait_seconds += waited
        m.tokens.inc(real)
        m.loss_tokens.inc(n_targets)
        m.padding.inc(pad)
        m.steps.inc()
        m.data_wait.observe(waited + self._unobserved)
        self._unobserved = 0.0
        self._lr = lr
        m.lr.set(lr)

    def skip_untrained(self, slots: list, pipe: Any, step: int) -> None:
        """A step whose batches hold no trained target: its slots released uncopied, the step counted, no
        update; rank 0 says why, the first time. `step`: the step's number less one."""
        masked = any(s.has_loss_mask for s in slots)
        for s in slots:
            pipe.release(s)  # never copied: free for the next batch at once
        self.summary.untrained_steps += 1
        if self.summary.untrained_steps > 1 or not self.dist.is_main:
            return
        log.warning("step %d: no trained target in this step's batches (%s); the step is counted, the model "
                    "is not updated (the summary says how often)", step + 1, untrained_reason(masked))  # fmt: skip

    def check_finite(self, step: int) -> None:
        """Before a checkpoint (every rank, the same step): the interval waiting to be reported and the steps
        since trained to a finite loss, or TrainingDiverged, so that a diverged model is not written over
        the good checkpoints (the steps since the last report are read here: a checkpoint syncs anyway)."""
        self.report()
        if not self.trained:
            return
        loss_all, targets_all = self.dist.sum([float(self._loss), self._targets])
        _check_finite(loss_all, targets_all, self._step + 1, step)

    def due(self, step: int) -> bool:
        return step % self.cfg.log_every == 0 or step == self.cfg.steps

    def close_interval(self, step: int, lr: float, norm: torch.Tensor, progress: Progress | None) -> None:
        """Close the interval ending at `step` and start the next. It is reported by the next report() (the
        trainer calls it once the next step is queued), or at once without REPORT_BEHIND."""
        self.report()  # an interval closes at most once a step: the last one is out by now
        parts = [self._loss, norm.detach().float().reshape(())]
        if self.scaler is not None:
            parts += self.scaler.device_values()
        values, done = torch.stack(parts), None
        if self._host is not None:
            dev = values
            values = self._host[: len(parts)]
            values.copy_(dev, non_blocking=True)  # on the device's stream, behind the interval's steps
            done = torch.cuda.Event(enable_timing=True)
            done.record(torch.cuda.current_stream(self.device))
        self._closed = _Closed(step, lr, values, done, self._targets, self._tokens, self._wait,
                               self.summary.tokens, progress)  # fmt: skip
        self._loss.zero_()  # after the copy: both are queued on this stream
        self._targets = self._tokens = 0
        self._wait = 0.0
        if not REPORT_BEHIND:
            self.report()

    def report(self, wait: bool = True) -> None:
        """Report the closed interval, if one waits: metrics, the log line or progress call, a history row.
        wait=False: only if its values have reached the host (before a wait for data, which may be long), and
        never under torchrun, where the report's exchange must happen on every rank at the same step."""
        c = self._closed
        if c is None or (not wait and (self.dist.enabled or (c.done is not None and not c.done.query()))):
            return
        self._closed = None
        if c.done is not None:
            c.done.synchronize()  # the interval's last step: the one queued behind it runs on meanwhile
        summary = self.summary
        # under torchrun, one exchange of host scalars
        loss_all, targets_all, tokens_all = self.dist.sum([float(c.values[0]), c.targets, c.tokens])
        if not self.trained:
            loss = 0.0  # --consume-only: nothing is trained
        else:  # no trained target in the whole interval: no loss to show (0 would read as perfect)
            _check_finite(loss_all, targets_all, self._step + 1, c.step)  # every rank sees the same sums
            loss = loss_all / targets_all if targets_all else math.nan
        now = time.perf_counter()  # about when the interval's last step ended on the device
        assert self._start is not None  # set with the first batch
        dt = now - self._start
        stats = {
            "loss": loss,
            "lr": c.lr,
            "grad_norm": float(c.values[1]),
            "tokens_per_second": c.tokens / dt if dt > 0 else 0.0,
            "data_wait": c.wait / dt if dt > 0 else 0.0,
            "step_seconds": dt / max(c.step - self._step, 1),
            "step": c.step,
            "elapsed": now - self.started,
            "padding_efficiency": summary.padding_efficiency,
            "mfu": 0.0,
            "loss_scale": float(c.values[2]) if self.scaler else 1.0,
        }
        self._publish(stats, c)
        if self.sinks:
            self.sinks.interval(c.step, stats)
        if not math.isnan(loss):
            summary.losses.append(loss)
        self._history_row(c.step, now, loss, tokens_all, c.wait, c.lr)
        if not self.dist.is_main:
            pass  # rank 0 speaks for the job
        elif c.progress:
            c.progress(c.step, {**stats, "tokens_per_second": tokens_all / dt if dt > 0 else 0.0})
        else:
            log.info(
                "step %d | loss %s | lr %.2e | %.0f tok/s | data wait %.1f%%",
                c.step,
                format_loss(loss),
                c.lr,
                stats["tokens_per_second"],
                100 * stats["data_wait"],
            )
        if self._steady is None:  # the steps after this interval's: their tokens, from its end on the device
            self._steady, self._steady_event = (now, c.tokens_so_far), c.done
        self._start, self._step = now, c.step

    def _publish(self, stats: dict, c: _Closed) -> None:
        m = self.metrics
        self.feed.observe_h2d()
        if not math.isnan(stats["loss"]):  # an interval without a trained target leaves the last loss
            m.loss.set(stats["loss"])
        m.grad_norm.set(stats["grad_norm"])
        m.loss_scale.set(stats["loss_scale"])
        if self.scaler is not None:
            overflows, skipped = float(c.values[3]), float(c.values[4])
            m.overflows.inc(overflows - self.published[0])
            m.skipped.inc(skipped - self.published[1])
            self.published = (overflows, skipped)
            stats["overflows"], stats["skipped"] = overflows, skipped
        if self.device.type == "cuda":
            m.gpu_memory.labels("allocated").set(torch.cuda.memory_allocated(self.device))
            m.gpu_memory.labels("reserved").set(torch.cuda.memory_reserved(self.device))
            m.gpu_memory.labels("peak").set(torch.cuda.max_memory_allocated(self.device))
            peak = peak_flops(torch.cuda.get_device_name(self.device))
            if peak:
                stats["mfu"] = stats["tokens_per_second"] * self.flops_per_token / peak
                m.mfu.set(stats["mfu"])

    def close_tail(self, step: int) -> None:
        """The loss of the steps after the last interval (every rank calls this: a collective), and their
        history row, so that `lmpipe plot` draws the run to its last step."""
        self.report()
        loss_all, targets_all, tokens_all = self.dist.sum([self._loss.item(), self._targets, self._tokens])
        if targets_all:
            self.summary.losses.append(loss_all / targets_all)
        if step > self._step and self._start is not None and tokens_all:
            loss = loss_all / targets_all if targets_all else math.nan
            self._history_row(step, time.perf_counter(), loss, tokens_all, self._wait, self._lr)

    def _history_row(
        self, step: int, now: float, loss: float, tokens_all: float, wait: float, lr: float
    ) -> None:
        """The summary's row for the interval from self._start to `now` (`lmpipe plot` draws them)."""
        assert self._start is not None
        dt = now - self._start
        self.summary.history.append({"step": step, "elapsed": now - self.started, "loss": loss, "lr": lr,
                                     "tokens_per_second": tokens_all / dt if dt > 0 else 0.0,  # every rank's
                                     "data_wait": wait / dt if dt > 0 else 0.0})  # fmt: skip

    def finish(
        self, step: int, stop_reason: str, graphs: CompiledGraphs, receive_thread: int | None
    ) -> Summary:
        """The summary, for the whole job (every rank calls this: collectives). `receive_thread`: the receive
        thread's native id, for --consume-only's time per stage."""
        summary, m = self.summary, self.metrics
        end_event = None
        if self.device.type == "cuda":
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record(torch.cuda.current_stream(self.device))
            torch.cuda.synchronize()
        end = time.perf_counter()
        summary.steps = step
        if self._steady is not None:
            # on CUDA between the device's own marks: the host may have reported the first interval late
            if self._steady_event is not None and end_event is not None:
                summary.steady_seconds = self._steady_event.elapsed_time(end_event) / 1e3
            else:
                summary.steady_seconds = end - self._steady[0]
            summary.steady_tokens = summary.tokens - self._steady[1]
        if self.dist.enabled:  # the summary speaks for the whole job
            summary.tokens, summary.pad_tokens, summary.steady_tokens, summary.targets = (
                int(v)
                for v in self.dist.sum(
                    [summary.tokens, summary.pad_tokens, summary.steady_tokens, summary.targets]
                )
            )
        peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else 0.0
        steady = summary.steady_tokens_per_second
        if peak and steady is not None:  # per GPU
            summary.steady_mfu = steady / self.dist.world_size * self.flops_per_token / peak
        # with no batch, the run's length is the wait for one ("no steps trained in 0.0 s" after minutes)
        summary.seconds = end - (self.run_start if self.run_start is not None else self.started)
        summary.first_loss = summary.losses[0] if summary.losses else float("nan")
        summary.last_loss = summary.losses[-1] if summary.losses else float("nan")
        summary.rejected, summary.stale, summary.refused = m.rejected_count, m.stale_count, m.refused_count
        summary.compiled_graphs = graphs.total
        if not self.trained:
            summary.consume = self._consume_stages(receive_thread)
        if stop_reason:
            summary.stopped_by = stop_reason
        elif self.cfg.steps and step >= self.cfg.steps:
            summary.stopped_by = "step limit"
        else:
            summary.stopped_by = "end of data"
        return summary

    def _consume_stages(self, receive_thread: int | None) -> dict[str, float]:
        """--consume-only: seconds per batch in the receive thread (receive, decode, validate, fill a slot;
        its CPU time), in the copy to the device, and waiting for data."""
        self.feed.observe_h2d()
        n = max(self.batches, 1)
        out = {
            # the job's batches (the summary's tokens are the job's too); the times per batch are this rank's
            "batches": self.dist.sum([float(self.batches)])[0],
            "ranks": float(self.dist.world_size),
            "copy_seconds_per_batch": self.feed.h2d_seconds / n,
            "wait_seconds_per_batch": self.summary.data_wait_seconds / n,
        }
        cpu = thread_cpu_seconds(receive_thread)
        if cpu is not None:
            out["receive_seconds_per_batch"] = cpu / n
            out["receive_busy"] = cpu / (time.perf_counter() - self.started)  # the thread's whole life
        return out
