"""The device feed: ready host slots in, model inputs on the device out.

take     ready slots in consumption order (the wait is data-wait time); the ledger (consumer/ledger.py) accepts
         each slot that is its shard's next batch; any other is dropped and counted, an `end` finishes its shard
copy     copy a slot's arrays to the device on a dedicated copy stream; the compute stream waits on the
         copy's event, never the host (to_device: the copy, then the model's inputs built from it)
release  hand a slot back to the receiver once its copy has completed (polled through the event, no sync)
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import torch

from lmpipe.consumer import ledger as verdicts
from lmpipe.consumer.datarecv import EndOfStream
from lmpipe.consumer.inputs import MaskCache, ModelInputs, build_inputs
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.receiver import Receiver
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")
HEALTH_EVERY = 0.2  # seconds between health checks (a waitpid per local producer: cheap)


class DeviceFeed:
    def __init__(
        self,
        receiver: Receiver,
        table: Ledger,
        metrics: TrainerMetrics,
        device: torch.device,
        *,
        copy_stream: bool,
        rows: int | None,
        attention: str,
        mask_cache: MaskCache,
        wait_timeout: float = 0.0,
    ):
        self.receiver, self.table, self.metrics = receiver, table, metrics
        self.device, self.rows, self.attention, self.mask_cache = device, rows, attention, mask_cache
        self.wait_timeout = wait_timeout
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream() if (cuda and copy_stream) else None
        self._in_flight: list[tuple[torch.cuda.Event, HostSlot]] = []  # (copy-done event, slot)
        self._h2d_timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, done) of each copy
        self.h2d_seconds = 0.0  # copies observed so far (the summary's per-batch copy time)
        self.health_check: Callable[[], str | None] | None = None  # a reason to stop (e.g. a dead producer)
        self._health_at = 0.0  # when health_check last ran

    # -- taking batches ------------------------------------------------------------------------------

    def take(self, n: int, stopping: Callable[[], bool]) -> tuple[list[HostSlot], float, str | None]:
        """Up to n slots in consumption order, the seconds waited for them, and a reason to stop the run
        (None to go on). Fewer than n only when every producer has finished or the run stops."""
        got: list[HostSlot] = []
        waited = 0.0
        last_news = time.monotonic()
        while len(got) < n and not stopping():
            if self.table.all_finished():
                break
            # asked while batches flow too: a producer that stopped on bad data must stop the run even while
            # the others keep the queue full (a changed corpus file was noticed 7 s late, after shard moves)
            now = time.monotonic()
            if self.health_check and now - self._health_at >= HEALTH_EVERY:
                self._health_at = now
                if problem := self.health_check():
                    return got, waited, problem
            t0 = time.perf_counter()
            try:
                item = self.receiver.ready.get(timeout=0.01)
            except queue.Empty:
                dt = time.perf_counter() - t0
                waited += dt
                self.metrics.data_waiting.inc(dt)
                self.release_done()
                self.check_receiver()
                now = time.monotonic()
                if now - last_news > 10:
                    log.info("waiting for batches: %s", self.receiver.wait_line(now))
                    last_news = now
                if self.wait_timeout and waited > self.wait_timeout:  # checked every poll, not every 10 s
                    return got, waited, f"no data for {waited:.0f} s (--wait-timeout {self.wait_timeout:g})"
                continue
            dt = time.perf_counter() - t0
            waited += dt
            self.metrics.data_waiting.inc(dt)
            last_news = time.monotonic()
            self.metrics.ready_slots.set(self.receiver.ready.qsize())
            if isinstance(item, EndOfStream):
                self._consume_end(item)
            elif self._accept(item):
                got.append(item)
        return got, waited, None

    def _accept(self, slot: HostSlot) -> bool:
        """Consume a slot if it is the next batch of its shard; drop it otherwise."""
        m = slot.meta
        assert m is not None
        why = self.table.accept(m.shard, m.session, m.seq, m.cursor)
        if why == verdicts.NEXT:
            return True
        self.metrics.drop_stale(why)
        if why == verdicts.GAP:  # the receiver asks for a resend, one request at a time, and logs it
            self.receiver.force_reset(m.shard, m.seq, m.received_at)
        self.receiver.release(slot)
        return False

    def _consume_end(self, end: EndOfStream) -> None:
        why = self.table.accept(end.shard, end.session, end.seq, end.cursor, end=True)
        if why == verdicts.NEXT:
            log.debug("shard %d finished its data", end.shard)
            if self.table.all_finished():
                log.info("all %d shards finished their data", len(self.table))
        elif why == verdicts.GAP:  # batches before it went missing: without a resend, a hang
            self.receiver.force_reset(end.shard, end.seq, end.received_at)

    def check_receiver(self) -> None:
        err = self.receiver.error
        if err is None:
            return
        self.receiver.stop(reason=f"the trainer failed: {err}")  # the producers learn why
        if isinstance(err, (ValueError, OSError)):  # says what happened and what to change: one line
            raise err
        raise RuntimeError(f"receive thread failed: {err}") from err

    # -- host -> device ------------------------------------------------------------------------------

    def to_device(self, slot: HostSlot) -> ModelInputs:
        # On CUDA the slot is released only later (release_done, this thread, once its copy is done), so
        # its host seg stays valid while the block mask is built from it on the host.
        seg_host = slot.views(self.rows)[2] if self.device.type == "cuda" else None
        tokens, lengths, seg, loss_mask = self.copy(slot)
        return build_inputs(
            tokens,
            lengths,
            seg,
            attention=self.attention,
            mask_cache=self.mask_cache,
            loss_mask=loss_mask,
            seg_host=None if seg_host is None else seg_host.numpy(),
        )

    def copy(
        self, slot: HostSlot
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The slot's (tokens, lengths, seg, loss_mask) on the device; the slot goes back to the receiver
        once copied."""
        tokens, lengths, seg = slot.views(self.rows)
        loss_mask = slot.loss_mask_view(self.rows)
        out: tuple[torch.Tensor | None, ...]
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            out = (
                tokens.to(torch.int64),
                lengths.clone(),
                None if seg is None else seg.to(torch.int32),
                None if loss_mask is None else loss_mask.clone(),
            )
            self._observe_h2d(time.perf_counter() - t0)
            self.receiver.release(slot)  # converted copies: the slot is free again
        else:
            stream = self.copy_stream or torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                out = tuple(
                    None if t is None else t.to(self.device, non_blocking=True)
                    for t in (tokens, lengths, seg, loss_mask)
                )
                done = torch.cuda.Event(enable_timing=True)
                done.record(stream)
            self._h2d_timing.append((start, done))  # read at the logging interval, once complete
            if self.copy_stream is not None:
                compute = torch.cuda.current_stream()
                compute.wait_event(done)
                # The device tensors were allocated on the copy stream but are read on the compute stream:
                # record_stream keeps the caching allocator from handing their memory to the next copy
                # before the compute that reads them has run. Events alone cannot express that.
                for t in out:
                    if t is not None:
                        t.record_stream(compute)
            # The pinned slot is reused only after its DMA finished: polled through the event, no sync.
            self._in_flight.append((done, slot))
        tokens_d, lengths_d, seg_d, mask_d = out
        assert tokens_d is not None and lengths_d is not None
        return tokens_d, lengths_d, seg_d, mask_d

    def observe_h2d(self) -> None:
        """Record the copy times of completed copies (at the logging interval: events are not synced)."""
        pending = []
        for start, done in self._h2d_timing:
            if done.query():
                self._observe_h2d(start.elapsed_time(done) / 1e3)
            else:
                pending.append((start, done))
        self._h2d_timing = pending

    def _observe_h2d(self, seconds: float) -> None:
        self.h2d_seconds += seconds
        self.metrics.h2d.observe(seconds)

    def release_done(self) -> None:
        keep = []
        for ev, slot in self._in_flight:
            if ev.query():
                self.receiver.release(slot)
            else:
                keep.append((ev, slot))
        self._in_flight = keep
