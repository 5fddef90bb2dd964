"""The trainer's receive side: a thread running an asyncio loop (uvloop) over two ZeroMQ sockets.

- PULL (data, consumer/datarecv.py): decode, validate and judge each message against the exactly-once
  ledger (consumer/ledger.py); copy what can be trained into a free host slot and hand it to the step loop
  through `ready`.
- ROUTER (control, consumer/coordinator.py): the handshake, who holds which shard, resends and liveness.

Who may connect at all is settled before either loop sees a byte (shared/sockets.py). If any task of this
thread dies, `error` says so and the trainer stops instead of running deaf. The ledger is shared with the
step loop under its lock: the receive thread reads it to answer hellos and to drop what can never be used;
the step loop (consumer/feed.py) records what it trains on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import zmq
import zmq.asyncio

from lmpipe.consumer.admission import Admission
from lmpipe.consumer.connections import DATA_EVENTS
from lmpipe.consumer.coordinator import Coordinator, PipelineError
from lmpipe.consumer.datarecv import DataReceiver
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.quiet import Rejects
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.messages import STOP_GRACE
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.security import start_zap
from lmpipe.shared.sockets import TRAINER_CONTROL, TRAINER_DATA, endpoints, open_socket

log = logging.getLogger("lmpipe.trainer")

__all__ = ["PipelineError", "Receiver"]


class Latch:
    """threading.Event's set/wait/is_set on a bare lock. Event.wait() takes its Condition's lock in Python
    code, where a KeyboardInterrupt (Ctrl-C in a library user's process) can land with the lock taken and
    never given back: the receive thread's set() would then block it for good, before it serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held until set()
        self._set = False

    def set(self) -> None:  # from the receive thread only
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True


class Receiver(threading.Thread):
    def __init__(
        self,
        cfg: PipelineConfig,
        fingerprint: dict[str, Any],
        slots: list[HostSlot],
        ledger: Ledger,
        metrics: TrainerMetrics,
        vocab_size: int,
        *,
        data_content: str = "",
        data_versions: list[str] | None = None,
    ):
        super().__init__(name="lmpipe-receiver", daemon=True)
        self.cfg, self.slots, self.ledger, self.metrics = cfg, slots, ledger, metrics
        self.admission = Admission(fingerprint, data_content, data_versions)
        rejects = Rejects(metrics)
        self.coordinator = Coordinator(cfg, ledger, metrics, self.admission, rejects)
        self.data = DataReceiver(cfg, ledger, metrics, vocab_size, self.coordinator.resends, rejects)
        self.ready = self.data.ready
        self.limits = self.data.limits
        self.bound = Latch()  # set once the sockets are bound (or could not be)
        self._error: BaseException | None = None
        self.endpoints = endpoints(cfg)  # creates and checks the runtime directory (ValueError if unsafe)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free: asyncio.Queue | None = None
        self._credit_lock = threading.Lock()
        self._credit_due: set[int] = set()  # shards whose credit rose, to be sent together

    @property
    def data_content(self) -> str:
        """The corpus files' contents producers must serve (pinned by the first producer if not given)."""
        return self.admission.data_content

    @property
    def data_versions(self) -> dict[str, str]:
        """The remote objects' versions producers must serve, by location."""
        return self.admission.data_versions

    @property
    def skipped(self) -> dict[str, int]:
        """Bad records the producers skipped, by reason."""
        return self.coordinator.skipped

    @property
    def error(self) -> BaseException | None:
        """Why training cannot go on, or None. Read by the step loop whenever it waits."""
        if self._error is None:
            self._error = self.coordinator.no_progress()
        return self._error

    @error.setter
    def error(self, exc: BaseException | None) -> None:
        self._error = exc

    # -- called from the step loop's thread ---------------------------------------------------------

    def release(self, slot: HostSlot) -> None:
        """Give a slot back once nothing reads it any more."""
        slot.meta = None
        assert self._loop is not None and self._free is not None  # the thread is running
        self._loop.call_soon_threadsafe(self._free.put_nowait, slot)

    def force_reset(self, shard: int, seq: int | None = None, arrived: float | None = None) -> None:
        """A message of `shard` came out of order (seq `seq`, received at `arrived`): ask its producer to
        resend from its consumed cursor (consumer/resends.py)."""
        why = f"sent seq {seq}" if seq is not None else "is out of order"
        assert self._loop is not None  # the thread is running
        self._loop.call_soon_threadsafe(self.coordinator.resends.request, shard, why, arrived)

    def credit(self, shard: int) -> None:
        """A mixture consumed a batch of `shard`: its holder may send one more. Coalesced: the shards due
        are sent from the receive thread's loop, one Credit per producer (consumer/coordinator.py)."""
        with self._credit_lock:
            first = not self._credit_due
            self._credit_due.add(shard)
        if first:
            assert self._loop is not None  # the thread is running
            self._loop.call_soon_threadsafe(self._send_credits)

    def _send_credits(self) -> None:
        with self._credit_lock:
            due, self._credit_due = self._credit_due, set()
        self.coordinator.grant(due)

    def connected(self, now: float) -> int:
        """Producers heard from lately (any thread: reads a snapshot)."""
        return self.coordinator.connected(now)

    def wait_line(self, now: float) -> str:
        """What the step loop is waiting on, in words (any thread: reads a snapshot)."""
        return self.coordinator.wait_line(now)

    def stop(self, reason: str = "", timeout: float | None = None) -> None:
        """Tell every producer to stop (when `reason` is given), close the sockets, end the thread: waited
        for up to `timeout` seconds (None: STOP_GRACE + 5, as it waits up to STOP_GRACE for the producers'
        `bye`); 0: only told (a second stop() waits). Idempotent."""
        timeout = STOP_GRACE + 5 if timeout is None else timeout
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self.coordinator.shutdown, reason)
        except RuntimeError:  # the loop closed in between (the thread failed)
            return
        if timeout <= 0:
            return
        self.join(timeout=timeout)
        if self.is_alive():
            log.warning("the receive thread did not finish within %.0f s of the stop", timeout)

    # -- the thread ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            import uvloop

            uvloop.run(self._main())
        except ImportError:  # uvloop is Linux/macOS only; asyncio's loop does the same job more slowly
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer through .error
            log.error("the receive thread failed", exc_info=exc)
            self.error = PipelineError(f"the trainer's receive thread failed ({type(exc).__name__}: {exc})")
            self.bound.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.coordinator.resends.loop = self._loop
        self._free = asyncio.Queue()
        for s in self.slots:
            self._free.put_nowait(s)
        ctx = zmq.asyncio.Context()
        ep = self.endpoints
        auth = None
        try:
            if ep.curve_dir:
                auth = start_zap(ctx, ep.curve_dir)
            ep.claim(self.cfg.port)
            pull = open_socket(ctx, TRAINER_DATA, self.cfg, ep, max_message=self.data.max_frame)
            router = open_socket(ctx, TRAINER_CONTROL, self.cfg, ep)
        except (OSError, ValueError) as exc:
            self.error = exc
            self.bound.set()
            if auth is not None:
                auth.stop()
            ctx.destroy(0)
            ep.release()
            return
        monitor = pull.get_monitor_socket(DATA_EVENTS)
        self.bound.set()
        try:
            await self._serve(pull, router, monitor)
        finally:
            pull.disable_monitor()
            monitor.close(0)
            pull.close(0)
            router.close(linger=500)  # let the stop messages out
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)  # term, and close whatever socket a cancelled task may have left open
            ep.release()

    async def _serve(
        self, pull: zmq.asyncio.Socket, router: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket
    ) -> None:
        """Run the loops until the stop (or a task's death), then wait for the producers' `bye`."""
        co = self.coordinator
        assert self._free is not None
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(self.data.recv_loop(pull, self._free, co.stopping), name="data"),
            asyncio.create_task(co.control_loop(router), name="control"),
            asyncio.create_task(self.data.monitor_loop(monitor, co.stopping), name="monitor"),
        ]
        stopping = asyncio.create_task(co.stopping.wait())
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t in done:  # a task that ends on its own is a bug: say so rather than run deaf
                err = t.exception()
                log.error("the receive thread's %s task died", t.get_name(), exc_info=err)
                self.error = PipelineError(
                    f"the trainer's {t.get_name()} task died ({type(err).__name__}: {err}); this is a bug, "
                    "please report it"
                    if err is not None
                    else f"the trainer's {t.get_name()} task ended; this is a bug, please report it"
                )
                co.shutdown("the trainer failed")
        # Every live producer acknowledges `stop` with `bye` (the control loop keeps running meanwhile and
        # repeats `stop` to each hello): behind a congested link the first one can take seconds to arrive.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(co.all_said_bye.wait(), timeout=STOP_GRACE)
        if co.awaiting_bye:
            log.warning(
                "%d producer(s) did not acknowledge the stop within %.0f s: %s",
                len(co.awaiting_bye),
                STOP_GRACE,
                ", ".join(sorted(co.awaiting_bye.values())),
            )
        for t in [*tasks, stopping]:
            t.cancel()
        # Bounded: a task cancelled in the middle of a ZeroMQ receive has been seen to take 25 s to end
        # (once in ~10 runs of 6 producers); closing the sockets below ends it in any case.
        _, late = await asyncio.wait([*tasks, stopping], timeout=1.0)
        if late:
            log.debug("receive tasks still ending after the stop: %s", ", ".join(t.get_name() for t in late))
