"""The trainer's receive side: a thread running an asyncio loop (uvloop) over two ZeroMQ sockets.

- PULL (data): decode and validate each message, drop what is malformed (counted by reason), from an old
  session or already consumed (counted as stale), copy the rest into a free host slot and hand it to the
  step loop through `ready`. With no free slot the loop stops reading, ZeroMQ's queues fill up and the
  producers block: backpressure all the way back to the tokenizers.
- ROUTER (control): handshake. A producer's hello is checked against the trainer's fingerprint; the
  answer is `welcome` (session, worker id, cursor of the last batch consumed from that worker, next
  sequence number) or `refuse` with the reason. Hellos repeat every second and serve as heartbeats.

Liveness rules (nothing retries the same failing thing forever):
- A batch of this session that is missing (a gap) or rejected makes the trainer ask its producer to
  resend from the last consumed batch: at most one request outstanding per worker, at most MAX_RESENDS
  at one position. A batch rejected again after a resend, or a position that never arrives intact, is a
  deterministic failure: that worker id is stopped (its producer is refused with the reason), and once no
  producer can make progress `error` holds a `PipelineError` that ends the run.
- Every control message, however malformed, is answered or dropped and counted; if any task of this
  thread dies, `error` says so and the trainer stops instead of running deaf.
- Worker ids: a producer started with `--worker -1` takes any free id and may be moved to another one
  when a producer that asked for that id by number arrives, so every free id is served.

Who may connect at all is settled before either loop sees a byte (shared/sockets.py). Within that, a worker
id changes hands only when its holder's control connection has closed (consumer/connections.py) or has
been silent for HOLDER_SILENCE seconds, and each new holder gets a fresh lease with its welcome: data
without the current holder's lease is dropped (counted as stale `not_holder`) before anything else looks
at it, so it is never trained, never ends a stream, and never counts as a gap or a rejected batch that
would make the holder rewind.

Consumption state lives in `WorkerTable`, shared with the step loop under a lock: the receive thread reads
it to answer hellos and to drop duplicates early; the step loop writes it as batches are trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmpipe.consumer.connections import ControlConnections
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, batch_from_message, batch_limits
from lmpipe.shared.config import PipelineConfig, mismatches
from lmpipe.shared.messages import ALIVE_SECONDS, HOLDER_SILENCE, STOP_GRACE
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.security import start_zap
from lmpipe.shared.sockets import TRAINER_CONTROL, TRAINER_DATA, endpoints, open_socket
from lmpipe.shared.wire import WireError, decode

log = logging.getLogger("lmpipe.trainer")

RESEND_TIMEOUT = 5.0  # a resend request not answered within this long may be repeated
MAX_RESENDS = 3  # resend requests at one position, without progress, before the worker is stopped
WANTED_SECONDS = 2 * ALIVE_SECONDS  # an id a producer asked for by number is not handed to --worker -1
ADVICE = (
    "Producers and trainer must run the same lmpipe version with the same settings; if they do, this is "
    "a bug: please report this message"
)


class PipelineError(ValueError):
    """A failure that training cannot get past (no producer can make progress, or the receive thread
    died); the message says what happened and what to change. A ValueError: the CLI prints it in one
    line and exits non-zero."""


@dataclass
class WorkerState:
    worker: int
    cursor: Cursor = field(default_factory=Cursor)  # after the last consumed batch
    last_seq: int = 0  # last consumed sequence number
    finished: bool = False
    identity: bytes | None = None
    last_seen: float = 0.0
    where: str = ""
    auto: bool = False  # its producer asked for any id (--worker -1), so it may be moved to another
    failed: str = ""  # why this id was stopped for good (a deterministic failure)
    # resend bookkeeping, receive thread only
    resend_at: int = -1  # last_seq when the last resend request went out
    resend_sent: float = 0.0
    resends: int = 0  # requests at resend_at so far
    answered_at: float = 0.0  # when seq resend_at + 1 arrived (accepted or not) after the request
    resend_due: str = ""  # why another request is wanted once the outstanding one times out
    rejected: dict[int, str] = field(default_factory=dict)  # seq -> why the receiver rejected it
    lease: str = ""  # the current holder's token (messages.Welcome.lease); new for every new holder
    fd: int = -1  # the holder's control connection (consumer/connections.py)


class WorkerTable:
    def __init__(self, n: int):
        self.lock = threading.Lock()
        self.workers = [WorkerState(i) for i in range(n)]

    def __getitem__(self, i: int) -> WorkerState:
        return self.workers[i]

    def __len__(self) -> int:
        return len(self.workers)

    def consumed(self, worker: int, seq: int, cursor: Cursor, finished: bool = False) -> None:
        with self.lock:
            w = self.workers[worker]
            w.last_seq, w.cursor = seq, cursor
            w.finished = w.finished or finished

    def stale(self, worker: int, session: str, seq: int, current_session: str) -> str | None:
        """Why a message of `worker` is not the next one to train on: "old_session", "duplicate" (at or
        before the last consumed seq) or "gap" (past the next one); None when it is the next. The receiver
        asks early, to drop what can never be used; the device feed asks again when it consumes."""
        if session != current_session:
            return "old_session"
        last = self.workers[worker].last_seq
        return "duplicate" if seq <= last else "gap" if seq > last + 1 else None

    def all_finished(self) -> bool:
        return all(w.finished for w in self.workers)

    def connected(self, now: float) -> int:
        return sum(1 for w in self.workers if _alive(w, now))

    def missing(self, now: float) -> list[int]:
        """Worker ids with no live producer that still have data to send."""
        return [w.worker for w in self.workers if not (_alive(w, now) or w.finished or w.failed)]

    def state_dict(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"cursor": w.cursor.to_dict(), "last_seq": w.last_seq, "finished": w.finished}
                for w in self.workers
            ]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        if len(state) != len(self.workers):
            raise ValueError(
                f"checkpoint has {len(state)} producer cursors, this run has {len(self.workers)} producers"
            )
        with self.lock:
            for w, s in zip(self.workers, state):
                w.cursor, w.last_seq, w.finished = (
                    Cursor.from_dict(s["cursor"]),
                    int(s["last_seq"]),
                    bool(s["finished"]),
                )


def _printable(text: str, limit: int = 300) -> str:
    """A peer's text made safe for one log line: escapes for control characters, bounded length."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def _alive(w: WorkerState, now: float) -> bool:
    return w.identity is not None and now - w.last_seen < ALIVE_SECONDS


def _holds(w: WorkerState, now: float) -> bool:
    """The worker id still belongs to its holder: its connection is open and it spoke not too long ago.
    Being silent for ALIVE_SECONDS (a stopped or busy process) is not enough to lose it."""
    return w.identity is not None and now - w.last_seen < HOLDER_SILENCE


@dataclass
class EndOfStream:
    worker: int
    seq: int
    cursor: Cursor
    session: str
    received_at: float = 0.0


class _Quiet:
    """Logs a repeating message the first time, then at most once per `every` seconds with a count."""

    def __init__(self, every: float = 60.0):
        self.every = every
        self.seen: dict[str, tuple[float, int]] = {}

    def __call__(self, level: int, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self.seen.get(key, (-math.inf, 0))
        if now - last < self.every:
            self.seen[key] = (last, skipped + 1)
            return
        if len(self.seen) > 1000:  # many distinct keys (a fuzzer): forget, never grow without bound
            self.seen.clear()
        self.seen[key] = (now, 0)
        log.log(level, msg + (f" ({skipped} more like it since)" if skipped else ""), *args)


class Receiver(threading.Thread):
    def __init__(
        self,
        cfg: PipelineConfig,
        fingerprint: dict[str, Any],
        slots: list[HostSlot],
        table: WorkerTable,
        metrics: TrainerMetrics,
        session: str,
        vocab_size: int,
    ):
        super().__init__(name="lmpipe-receiver", daemon=True)
        self.cfg, self.slots, self.table = cfg, slots, table
        self.fingerprint = (
            fingerprint  # the trainer's own dict: the first producer pins "data" for checkpoints too
        )
        self.metrics, self.session, self.vocab_size = metrics, session, vocab_size
        self.ready: queue.Queue = queue.Queue()
        self.bound = threading.Event()
        self._error: BaseException | None = None
        # What a valid batch can hold, not a constant: the same function the tests check batches against.
        self.limits = batch_limits(cfg.batch_size, cfg.seq_len)
        # ZeroMQ cuts a connection that sends a bigger frame (a memory guard; counted as a disconnect).
        # Frames between the exact limit and this are read, then rejected and counted as oversized.
        self._max_frame = 4 * self.limits.max_frame_bytes + (1 << 20)
        self.endpoints = endpoints(cfg)  # creates and checks the runtime directory (ValueError if unsafe)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._free: asyncio.Queue | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._reject_logged: dict[str, int] = {}
        self._quiet = _Quiet()
        self._wanted: dict[int, float] = {}  # worker id -> when a producer last asked for it by number
        self._stop_reason = ""
        self._awaiting_bye: dict[
            bytes, str
        ] = {}  # identity -> "worker (host:pid)" told to stop, not yet gone
        self._all_said_bye: asyncio.Event | None = None
        for w in range(len(table)):
            metrics.stream_resets.labels(str(w))

    @property
    def error(self) -> BaseException | None:
        """Why training cannot go on, or None. Read by the step loop whenever it waits."""
        if self._error is None:
            self._error = self._no_progress()
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

    def force_reset(self, worker: int, seq: int | None = None, arrived: float | None = None) -> None:
        """A message of `worker` came out of order (seq `seq`, received at `arrived`): ask its producer to
        resend from its consumed cursor, within the limits above."""
        why = f"sent seq {seq}" if seq is not None else "is out of order"
        assert self._loop is not None  # the thread is running
        self._loop.call_soon_threadsafe(self._request_resend, worker, why, arrived)

    def stop(self, reason: str = "") -> None:
        """Tell every producer to stop (when `reason` is given), close the sockets, end the thread."""
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._shutdown, reason)
        except RuntimeError:  # the loop closed in between (the thread failed)
            return
        self.join(timeout=STOP_GRACE + 5)  # it waits up to STOP_GRACE for the producers' `bye`

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
        self._stopping = asyncio.Event()
        self._all_said_bye = asyncio.Event()
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
            pull = open_socket(ctx, TRAINER_DATA, self.cfg, ep, max_message=self._max_frame)
            router = open_socket(ctx, TRAINER_CONTROL, self.cfg, ep)
        except (OSError, ValueError) as exc:
            self.error = exc
            self.bound.set()
            if auth is not None:
                auth.stop()
            ctx.destroy(0)
            ep.release()
            return
        self._router = router
        monitor = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.bound.set()
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(self._recv_loop(pull), name="data"),
            asyncio.create_task(self._control_loop(router), name="control"),
            asyncio.create_task(self._monitor_loop(monitor), name="monitor"),
        ]
        stopping = asyncio.create_task(self._stopping.wait())
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
                self._shutdown("the trainer failed")
        # Every live producer acknowledges `stop` with `bye` (the control loop keeps running meanwhile and
        # repeats `stop` to each hello): behind a congested link the first one can take seconds to arrive.
        with contextlib.suppress(TimeoutError):
            assert self._all_said_bye is not None
            await asyncio.wait_for(self._all_said_bye.wait(), timeout=STOP_GRACE)
        if self._awaiting_bye:
            log.warning(
                "%d producer(s) did not acknowledge the stop within %.0f s: %s",
                len(self._awaiting_bye),
                STOP_GRACE,
                ", ".join(sorted(self._awaiting_bye.values())),
            )
        for t in [*tasks, stopping]:
            t.cancel()
        await asyncio.gather(*tasks, stopping, return_exceptions=True)
        pull.disable_monitor()
        monitor.close(0)
        pull.close(0)
        router.close(linger=500)  # let the stop messages out
        if auth is not None:
            auth.stop()
        ctx.term()
        ep.release()

    def _shutdown(self, reason: str) -> None:
        assert self._stopping is not None
        if self._stopping.is_set():
            return
        self._stop_reason = reason
        if reason and self._router is not None:
            for w in self.table.workers:
                if w.identity is not None:
                    self._send(w.identity, messages.Stop(reason))
                    # Every open connection, not only producers heard from lately: behind a congested link
                    # a live producer's hellos arrive late. A dead one's connection closes (heartbeats).
                    self._awaiting_bye[w.identity] = f"{w.worker} ({w.where})"
                    log.debug("told producer %d to stop", w.worker)
        assert self._all_said_bye is not None
        if not self._awaiting_bye:
            self._all_said_bye.set()
        self._stopping.set()

    # -- data ---------------------------------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        self.metrics.reject(reason)
        n = self._reject_logged.get(reason, 0) + 1
        self._reject_logged[reason] = n
        if n <= 5 or n % 1000 == 0:
            log.warning("dropped a message (%s, #%d): %s", reason, n, _printable(detail))

    def _origin(self, hdr: Any) -> tuple[WorkerState, int] | None:
        """The worker of this session and the seq a message's header names, if it names them and carries
        that worker's current lease (only then may a rejected batch ask for a resend)."""
        if not isinstance(hdr, dict) or hdr.get("session") != self.session:
            return None
        worker, seq = hdr.get("worker"), hdr.get("seq")
        if type(worker) is not int or type(seq) is not int or not 0 <= worker < len(self.table):
            return None
        if hdr.get("lease") != self.table[worker].lease:
            return None
        return self.table[worker], seq

    def _rejected(self, exc: WireError, hdr: Any) -> None:
        """Drop a message and, when it is a batch of this session still wanted, get it sent again;
        a batch rejected a second time is a deterministic failure."""
        origin = self._origin(hdr)
        if origin is None:
            self._reject(exc.reason, exc.detail)
            return
        w, seq = origin
        self._reject(exc.reason, f"worker {w.worker} seq {seq}: {exc.detail}")
        self._arrived(w, seq, time.monotonic())
        if seq <= w.last_seq or w.failed:
            return
        why = f"{exc.reason}: {exc.detail}"
        if seq in w.rejected:
            self._fail(w.worker, f"its batch seq {seq} is rejected every time it is sent ({why})")
            return
        for s in [s for s in w.rejected if s <= w.last_seq]:
            del w.rejected[s]
        if len(w.rejected) < 256:
            w.rejected[seq] = why
        self._request_resend(w.worker, f"batch seq {seq} was rejected ({why})")

    async def _recv_loop(self, pull: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await pull.recv_multipart(copy=False)
            except zmq.Again:  # woken with nothing to read (seen while a CURVE handshake fails): go on
                continue
            now = time.monotonic()
            try:
                msg = decode(frames, self.limits)
            except WireError as exc:
                self._rejected(exc, exc.header)
                continue
            hdr = msg.header
            worker = hdr["worker"]
            if worker >= len(self.table):
                self._reject("bad_worker", f"worker {worker} but this run has {len(self.table)} producers")
                continue
            why = self.table.stale(worker, hdr["session"], hdr["seq"], self.session)
            if why == "old_session":
                self.metrics.drop_stale(why)
                continue
            if hdr.get("lease") != self.table[worker].lease:  # not from this worker id's current holder
                self.metrics.drop_stale("not_holder")
                continue
            self._arrived(self.table[worker], hdr["seq"], now)
            if msg.kind == "end":
                self.ready.put(
                    EndOfStream(worker, hdr["seq"], Cursor.from_dict(hdr["cursor"]), hdr["session"], now)
                )
                continue
            try:
                batch = batch_from_message(msg, self.vocab_size, self.cfg.seq_len, self.cfg.batch_size)
                if hdr["strategy"] != self.cfg.strategy:
                    raise WireError(
                        "bad_batch", f"strategy {hdr['strategy']!r}, this run trains on {self.cfg.strategy!r}"
                    )
            except WireError as exc:
                self._rejected(exc, hdr)
                continue
            if why == "duplicate":  # a gap is the device feed's to judge: the missing batch may be queued
                self.metrics.drop_stale(why)
                continue
            self.metrics.received.labels(str(worker)).inc()
            assert self._free is not None
            slot = await self._free.get()
            slot.fill(batch, worker, hdr["seq"], hdr["session"], now)
            del msg, batch, frames  # release the ZeroMQ buffers before waiting again
            self.ready.put(slot)
            self.metrics.ready_slots.set(self.ready.qsize())

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        """Counts data connections that close: a producer that exited, or one ZeroMQ cut off for a frame
        over the size guard (the frame itself never reaches `decode`)."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.Again:
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.metrics.data_disconnects.inc()
                self._quiet(
                    logging.INFO,
                    "disconnect",
                    "a producer's data connection closed (it exited, or sent a frame over %d bytes)",
                    self._max_frame,
                )

    # -- resends and deterministic failures ----------------------------------------------------------

    def _arrived(self, w: WorkerState, seq: int, now: float) -> None:
        if w.resend_sent and not w.answered_at and seq == w.resend_at + 1:
            w.answered_at = now

    def _request_resend(self, worker: int, why: str, arrived: float | None = None) -> None:
        w = self.table[worker]
        now = time.monotonic()
        if w.failed or w.finished or not _alive(w, now):
            return  # nothing more is wanted, or a producer that (re)joins is sent to the cursor anyway
        with self.table.lock:
            last = w.last_seq
        if w.resend_at != last:  # progress since the last request: start counting afresh
            w.resend_at, w.resends, w.resend_sent, w.answered_at, w.resend_due = last, 0, 0.0, 0.0, ""
        elif arrived is not None and arrived < max(w.resend_sent, w.answered_at):
            return  # sent before the producer rewound; the resent stream is on its way
        elif not w.answered_at and now - w.resend_sent < RESEND_TIMEOUT:
            if not w.resend_due:  # look again when the outstanding request times out
                assert self._loop is not None
                self._loop.call_later(w.resend_sent + RESEND_TIMEOUT - now, self._resend_timeout, worker)
            w.resend_due = why
            return
        if w.resends >= MAX_RESENDS:
            self._fail(
                worker,
                f"batch seq {last + 1} never arrived intact after {MAX_RESENDS} resend requests ({why})",
            )
            return
        w.resends += 1
        w.resend_sent, w.answered_at, w.resend_due = now, 0.0, ""
        self.metrics.stream_resets.labels(str(worker)).inc()
        log.warning(
            "worker %d %s, expected %d: asking it to resend (%d/%d)",
            worker,
            why,
            last + 1,
            w.resends,
            MAX_RESENDS,
        )
        self._send_welcome(worker, force=True)

    def _resend_timeout(self, worker: int) -> None:
        w = self.table[worker]
        why, w.resend_due = w.resend_due, ""
        if why:
            self._request_resend(worker, why)

    def _fail(self, worker: int, reason: str) -> None:
        w = self.table[worker]
        if w.failed:
            return
        w.failed = reason
        self.metrics.workers_failed.set(sum(1 for x in self.table.workers if x.failed))
        log.error("stopped worker %d: %s. %s", worker, reason, ADVICE)
        if w.identity is not None:
            self._send(
                w.identity,
                messages.Refuse(f"the trainer stopped worker {worker}: {reason}. {ADVICE}", retry=False),
            )

    def _no_progress(self) -> PipelineError | None:
        failed = [w for w in self.table.workers if w.failed]
        if failed and all(w.finished or w.failed for w in self.table.workers):
            return PipelineError(
                "no producer can make progress: "
                + "; ".join(f"worker {w.worker}: {w.failed}" for w in failed)
                + f". {ADVICE}"
            )
        return None

    # -- control ------------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        # NOBLOCK sends on an asyncio socket finish at once; a failure lands on the returned future.
        assert self._router is not None
        fut = cast(
            "asyncio.Future[Any]", self._router.send_multipart([identity, messages.pack(msg)], zmq.NOBLOCK)
        )
        if fut.done() and fut.exception() is not None:
            log.debug(
                "control send failed: %s", fut.exception()
            )  # the producer went away; it says hello again

    def _send_welcome(self, worker: int, force: bool = False) -> None:
        w = self.table[worker]
        if w.identity is None:
            return
        with self.table.lock:
            welcome = messages.Welcome(
                self.session, worker, w.cursor.to_dict(), w.last_seq + 1, force, lease=w.lease
            )
        self._send(w.identity, welcome)

    def _tick(self) -> None:
        self.metrics.producers.set(self.table.connected(time.monotonic()))

    async def _control_loop(self, router: zmq.asyncio.Socket) -> None:
        conns = ControlConnections(router)
        try:
            while True:
                try:
                    got = await asyncio.wait_for(router.recv_multipart(copy=False), timeout=1.0)
                except (TimeoutError, zmq.Again):  # zmq.Again: woken with nothing to read
                    got = None
                for fd in conns.closed():  # first: the message may come on a new connection, a reused fd
                    self._disconnected(fd)
                if got is None:
                    self._tick()
                    continue
                try:
                    self._control([f.bytes for f in got], conns.fd(got[-1]))
                except Exception as exc:  # a bug must not take the handshake down with it: count, go on
                    self._reject(
                        "bad_control", f"{type(exc).__name__} while handling a control message: {exc}"
                    )
                    log.debug("control message", exc_info=True)
                self._tick()
        finally:
            conns.close()

    def _said_bye(self, identity: bytes) -> None:
        if self._awaiting_bye.pop(identity, None) and not self._awaiting_bye:
            assert self._all_said_bye is not None
            self._all_said_bye.set()

    def _disconnected(self, fd: int) -> None:
        """A control connection closed: the worker id it held is free for a new holder."""
        for w in self.table.workers:
            if w.identity is not None and w.fd == fd:
                self._said_bye(w.identity)  # gone is as good as a `bye` to a stopping trainer
                w.identity, w.fd = None, -1
                log.info("producer %d (%s) disconnected", w.worker, w.where)

    def _control(self, frames: list[bytes], fd: int = -1) -> None:
        if len(frames) != 2:
            self._reject("bad_control", f"control message of {len(frames) - 1} frames, expected 1")
            return
        identity, raw = frames
        try:
            msg = messages.unpack(raw)
        except WireError as exc:
            self._reject(exc.reason, exc.detail)
            self.metrics.refusals.labels("malformed").inc()
            # a producer of another version learns why instead of retrying forever
            self._send(identity, messages.Refuse(f"malformed control message: {exc.detail}", retry=False))
            return
        if self._stopping is not None and self._stopping.is_set():
            if isinstance(msg, messages.Bye):
                self._said_bye(identity)
            elif isinstance(msg, messages.Hello) and self._stop_reason:  # the first stop is still on its way
                self._send(identity, messages.Stop(self._stop_reason))
            return
        if isinstance(msg, messages.Hello):
            self._hello(identity, msg, fd)
        else:
            self._reject(
                "bad_control", f"a producer sent {type(msg).__name__.lower()}, only hello is expected"
            )

    def _hello(self, identity: bytes, hello: messages.Hello, fd: int = -1) -> None:
        now = time.monotonic()
        where = _printable(f"{hello.host}:{hello.pid}", 80)
        n = len(self.table)
        if not -1 <= hello.worker < n:
            reason = f"worker id {hello.worker} is outside 0..{n - 1} (trainer runs {n} producers)"
            return self._refuse(identity, where, reason, "bad_worker_id")
        if hello.worker >= 0 and hello.session == self.session and not hello.rejoin:
            w = self.table[hello.worker]
            if w.identity == identity:  # a heartbeat
                w.last_seen, w.fd = now, fd
                if w.failed:  # still here after being stopped (its refusal was lost): say it again
                    self._refuse(
                        identity, where, f"worker {w.worker} was stopped: {w.failed}", "worker_stopped"
                    )
                return
        pinned = bool(self.fingerprint.get("data"))
        diff = mismatches(self.fingerprint, hello.fingerprint, skip=() if pinned else ("data",))
        if diff:
            return self._refuse(identity, where, "config mismatch: " + "; ".join(diff), "config_mismatch")
        if not pinned:
            self.fingerprint["data"] = hello.fingerprint.get("data", "")  # the first producer pins the corpus
        if hello.auto or hello.worker == -1:
            wid = self._pick_id(identity, hello.worker, now)
            if wid is None:
                return self._busy(identity, where, f"all {n} worker ids are taken")
        else:
            wid = hello.worker
            self._wanted[wid] = now
            w = self.table[wid]
            if w.failed:
                return self._refuse(
                    identity, where, f"worker {wid} was stopped: {w.failed}", "worker_stopped"
                )
            if w.identity != identity and _holds(w, now):  # only a holder known to be gone gives it up
                free = self._pick_id(None, -1, now, exclude=wid) if w.auto else None
                if free is None:
                    return self._busy(identity, where, f"worker {wid} is already connected from {w.where}")
                self._move(wid, free, where)
        w = self.table[wid]
        if w.identity == identity and hello.session == self.session and hello.worker == wid:
            w.last_seen, w.fd = now, fd
            if hello.rejoin:  # same session: the producer only lost its connection; let it carry on
                self._send_welcome(wid)
            return
        for other in self.table.workers:  # an auto producer that was moved may still name its old id
            if other.identity == identity and other is not w:
                other.identity = None
        if w.identity != identity:
            w.lease = secrets.token_hex(16)
        w.identity, w.last_seen, w.where, w.auto = identity, now, where, hello.auto or hello.worker == -1
        w.fd = fd
        self._send_welcome(wid)
        log.info("producer %d joined from %s (resumes at seq %d)", wid, where, w.last_seq + 1)

    def _pick_id(self, identity: bytes | None, preferred: int, now: float, exclude: int = -1) -> int | None:
        """A worker id for a producer that takes any: the one it holds, else the one it names if free,
        else a free one, preferring ids nobody asked for by number, unfinished ones, the longest silent."""
        held = [w.worker for w in self.table.workers if identity is not None and w.identity == identity]
        if held and not self.table[held[0]].failed:
            return held[0]
        free = [
            w
            for w in self.table.workers
            if w.worker != exclude and not w.failed and (w.identity == identity or not _holds(w, now))
        ]
        if not free:
            return None
        if 0 <= preferred < len(self.table) and self.table[preferred] in free:
            return preferred

        def rank(w: WorkerState) -> tuple:
            wanted = now - self._wanted.get(w.worker, -math.inf) < WANTED_SECONDS
            return (wanted, w.finished, w.last_seen, w.worker)

        return min(free, key=rank).worker

    def _move(self, src: int, dst: int, asker: str) -> None:
        """Hand an auto-assigned producer's id to a producer that asked for it by number; the auto one
        continues as `dst`. Both ids' streams are deterministic, so nothing is lost or repeated."""
        a, b = self.table[src], self.table[dst]
        b.identity, b.last_seen, b.where, b.auto, b.fd = a.identity, a.last_seen, a.where, True, a.fd
        b.lease = secrets.token_hex(16)
        a.identity, a.auto, a.fd = None, False, -1
        log.info(
            "moved the producer at %s from worker id %d to %d: %s asked for id %d",
            b.where,
            src,
            dst,
            asker,
            src,
        )
        self._send_welcome(dst, force=True)

    def _busy(self, identity: bytes, where: str, reason: str) -> None:
        self.metrics.refuse("busy")
        self._quiet(logging.INFO, f"busy {where}", "producer at %s waits: %s", where, reason)
        self._send(identity, messages.Refuse(reason, retry=True))

    def _refuse(self, identity: bytes, where: str, reason: str, code: str) -> None:
        self.metrics.refuse(code)  # a REFUSAL_REASONS code; also counted as a rejected message (handshake)
        # once a minute per peer: a misconfigured producer exits, but a buggy or hostile one may not
        self._quiet(logging.ERROR, f"refuse {where}", "refused producer at %s: %s", where, _printable(reason))
        self._send(identity, messages.Refuse(reason, retry=False))
