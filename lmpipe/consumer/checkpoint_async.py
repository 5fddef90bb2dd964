"""Checkpoints written while training goes on: the state copied into host memory, then written by a thread.

At a step boundary `CheckpointWriter.save` copies every tensor of the state (model, optimizer, scaler, RNG)
into host buffers allocated at the first checkpoint and reused by every later one (pinned on CUDA: the
copies are queued with non_blocking on a stream of their own, then waited for once), and deep-copies the
rest (the step, every rank's cursors, the header). The step loop waits only for that copy; a thread then
writes the copy with CheckpointManager.save, the same write as a synchronous checkpoint's (temporary
folder, fsync, rename, header with the state's sha256, the `latest` pointer, keep-K). Training goes on
meanwhile and never touches the copy: what lands on disk is the state and cursors of the snapshotted step.

At most one write is in flight: a checkpoint due while the last one is still being written says so in one
line and waits for it (the buffers are the last write's until it is done), never queues nor skips. A write
that failed is raised in the step loop at the next step (under torchrun, where only rank 0 knows, at the
next checkpoint or the run's end, on every rank), as a synchronous failure is (consumer/trainer.py).

Why not torch.distributed.checkpoint.async_save (torchtitan's async checkpointing is built on it): it writes
DCP's own layout (a .metadata file and one .distcp file per rank, planned for sharded tensors), where an
lmpipe checkpoint is one state.pt read by torch.load(weights_only=True) only after its sha256 matched the
header's, with a header compared field by field before anything is loaded, a `latest` pointer and keep-K
(consumer/checkpoint.py), which `lmpipe export` and older checkpoints rely on. Under DDP every rank's model
is whole, so there is nothing to shard: rank 0 writes, as synchronously. What async_save adds over a thread
is its staging, pinned CPU copies made once and refilled with non_blocking copies: HostSnapshot below.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from lmpipe.consumer.checkpoint import CheckpointManager
from lmpipe.consumer.distributed import Dist
from lmpipe.shared.metrics import TrainerMetrics

log = logging.getLogger("lmpipe.trainer")


def resolve_mode(mode: str, device: torch.device) -> str:
    """--checkpoint-mode auto: async on CUDA (the copy to host memory is fast and the GPU goes on), sync
    elsewhere (on a CPU the copy costs what the write saves, and a synchronous run is easier to follow)."""
    if mode == "auto":
        return "async" if device.type == "cuda" else "sync"
    return mode


class HostSnapshot:
    """A copy of a state in host memory: each tensor into a buffer of its own, allocated the first time its
    place in the state is seen and reused by every later snapshot (pinned on CUDA); everything that is not a
    tensor deep-copied. Tensors that share storage (tied weights) share it in the copy too, so state.pt holds
    them once and loaders re-tie them as they would a synchronous checkpoint's."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.copy_seconds = 0.0  # the last copy's, on the device (CUDA)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, state: Any) -> Any:
        """The copy; returns once it is complete (on CUDA: after the copies queued behind the step's work).
        The wait is the step loop's, not the writer thread's: a thread that waits on a CUDA event while the
        step loop captures its CUDA graphs (consumer/fast/step_graph.py, global capture mode) may break the
        capture. The trainer checks the step's loss before a checkpoint, which waits for the step, so the wait
        here is mostly the copy's own: copy_seconds, timed on the device."""
        if self._stream is None:
            return self._copy(state, (), {})
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step's last kernels
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            out = self._copy(state, (), {})
            done.record()
        done.synchronize()  # the one wait of the step loop
        self.copy_seconds = start.elapsed_time(done) / 1000
        return out

    def _copy(self, obj: Any, where: tuple, seen: dict[tuple, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, where, seen)
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._copy(v, (*where, k), seen)
            if hasattr(obj, "_metadata"):  # a module's state_dict: load_state_dict reads its versions
                out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*where, i), seen) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else type(obj)(items)
        return copy.deepcopy(obj)  # numbers, strings, cursors' dicts: the snapshotted step's values

    def _tensor(self, t: torch.Tensor, where: tuple, seen: dict[tuple, torch.Tensor]) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):  # a tensor subclass: a plain blocking copy
            return t.detach().to("cpu", copy=True)
        alias = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if alias in seen:
            return seen[alias]
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[where] = self._allocate(t)
        buf.copy_(t.detach(), non_blocking=self.cuda and t.is_cuda)
        seen[alias] = buf
        return buf

    def _allocate(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        except RuntimeError as exc:  # pinned memory is page-locked RAM: a host may refuse that much
            raise OSError(
                f"cannot allocate {t.numel() * t.element_size() / 2**20:,.0f} MiB of "
                f"{'pinned ' if self.cuda else ''}host memory for the checkpoint's snapshot (already "
                f"{self.nbytes / 2**30:.2f} GiB): {(str(exc).splitlines() or [''])[0]}; --checkpoint-mode sync "
                "writes from the device without a copy"
            ) from None


class CheckpointWriter:
    """CheckpointManager.save, in the step loop (sync) or in a thread on a host snapshot (async); `mode`
    as --checkpoint-mode. A write that lands is counted in `metrics`."""

    def __init__(self, manager: CheckpointManager, mode: str, device: torch.device, metrics: TrainerMetrics):
        mode = resolve_mode(mode, device)
        if mode not in ("async", "sync"):
            raise ValueError(f"checkpoint mode {mode!r}: auto, async or sync")
        self.manager, self.mode, self.metrics = manager, mode, metrics
        self.snapshot = HostSnapshot(device) if mode == "async" else None
        self.last_step: int | None = None  # of the last checkpoint saved (or whose write started) by this run
        self._thread: threading.Thread | None = None
        self._step = 0  # the step of the write in flight
        self._started = 0.0
        self._error: BaseException | None = None
        # the last checkpoint's stop of the step loop, in parts: the wait for the write before, the copy to
        # host memory with the header's (async), the write (sync); the copy's device seconds are the
        # snapshot's copy_seconds (async on CUDA)
        self.last_stop: dict[str, float] = {}

    @property
    def background(self) -> bool:
        return self.snapshot is not None

    @property
    def in_flight(self) -> int | None:
        """The step whose write is running, or None."""
        return self._step if self._thread is not None and self._thread.is_alive() else None

    def holds(self, step: int) -> bool:
        """Whether the last checkpoint (the last this run saved or started to, else the latest on disk) is
        of `step`."""
        return (self.last_step if self.last_step is not None else self.manager.latest_step()) == step

    def save(self, step: int, header: dict[str, Any], state: dict[str, Any]) -> float:
        """Write the checkpoint of `step` (async: snapshot it and start its write); the seconds the step loop
        was held up. Raises the error of the last background write, if that one failed."""
        t0 = time.perf_counter()
        if (running := self.in_flight) is not None:
            log.warning(
                "checkpoint step %d is due while the write of step %d is still running (%.1f s so far); "
                "waiting for it (one write at a time)",
                step, running, time.monotonic() - self._started,
            )  # fmt: skip
        self._join()
        if self.snapshot is None:
            t1 = time.perf_counter()
            self._written(step, self.manager.save(step, header, state), time.perf_counter() - t1)
            self.last_stop = {"wait": t1 - t0, "copy": 0.0, "write": time.perf_counter() - t1}
            self.last_step = step
            self.metrics.checkpoint_blocked_seconds.observe(blocked := time.perf_counter() - t0)
            return blocked
        first = not self.snapshot.nbytes
        t1 = time.perf_counter()
        state, header = self.snapshot.take(state), copy.deepcopy(header)
        self.metrics.checkpoint_blocked_seconds.observe(blocked := time.perf_counter() - t0)
        self.last_stop = {"wait": t1 - t0, "copy": time.perf_counter() - t1}
        if first:
            log.info("checkpoint snapshots go to %.2f GiB of %shost memory, allocated now and reused",
                     self.snapshot.nbytes / 2**30, "pinned " if self.snapshot.cuda else "")  # fmt: skip
        self.last_step, self._step, self._started = step, step, time.monotonic()
        self._thread = threading.Thread(
            target=self._write, args=(step, header, state, blocked), name="checkpoint-writer", daemon=True
        )
        self._thread.start()
        return blocked

    def _write(self, step: int, header: dict[str, Any], state: dict[str, Any], blocked: float) -> None:
        t0 = time.perf_counter()
        try:
            path = self.manager.save(
                step, header, state, how=f"in the background; the step loop waited {blocked:.2f} s"
            )
            self._written(step, path, time.perf_counter() - t0)
        except BaseException as exc:  # raised in the step loop (check, save, finish)
            self._error = exc

    def _written(self, step: int, path: Path, seconds: float) -> None:
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(seconds)
        self.metrics.checkpointed(step, time.time())

    def check(self) -> None:
        """Raise the error of a background write that failed (once); cheap enough for every step."""
        if self._error is not None and self.in_flight is None:
            error, self._error = self._error, None
            raise error

    def finish(self, why: str) -> None:
        """The run ends (`why`): wait for the write in flight, saying so; raise its error if it failed."""
        if (running := self.in_flight) is not None:
            log.info("%s: waiting for the checkpoint write of step %d in flight (%.1f s so far)",
                     why, running, time.monotonic() - self._started)  # fmt: skip
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def finish_all(self, dist: Dist, why: str) -> None:
        """The end of a run, SIGTERM/SIGINT included, on every rank: rank 0 waits for the write in flight (and
        says so); every rank then knows whether it landed, and a failed one stops each as a synchronous one."""
        error: OSError | None = None
        if dist.is_main:
            try:
                self.finish(why)
            except OSError as exc:
                error = exc
        if not dist.broadcast(error is None):
            raise error or OSError("rank 0 could not write the checkpoint (its log says why)")

    def abandon(self, why: str) -> None:
        """A run that failed: the last good checkpoint's write still lands (waited for, said); its own
        failure is said in one line beside the run's error. No collective: other ranks may be gone."""
        try:
            self.finish(why)
        except Exception as exc:
            log.error("%s", exc)
