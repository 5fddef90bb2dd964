"""The trainer's receive side: a thread running an asyncio loop (uvloop) over two ZeroMQ sockets.

- PULL (data): decode and validate each message, drop what is malformed (counted by reason), from an old
  session or already consumed (counted as stale), copy the rest into a free host slot and hand it to the
  step loop through `ready`. With no free slot the loop stops reading, ZeroMQ's queues fill up and the
  producers block: backpressure all the way back to the tokenizers.
- ROUTER (control): handshake and shard assignment. A producer's hello is checked against the trainer's
  fingerprint; a new producer is answered with `assign` (the shards it holds now, possibly none) and one
  `welcome` per shard (session, shard, cursor of the last batch consumed from that shard, next sequence
  number, lease), or `refuse` with the reason. Every join and every leave re-divides the open shards
  (consumer/assign.py): a shard that changes hands gets a new lease, so its old holder's batches still
  in flight are dropped, and its new holder starts after the last batch the trainer accepted. Hellos
  repeat every second, serve as heartbeats and name the shards held; a difference is answered again.

Liveness rules (nothing retries the same failing thing forever):
- A batch of this session that is missing (a gap) or rejected makes the trainer ask its producer to
  resend from the last consumed batch: at most one request outstanding per worker, at most MAX_RESENDS
  at one position. A batch rejected again after a resend, or a position that never arrives intact, is a
  deterministic failure: that worker id is stopped (its producer is refused with the reason), and once no
  producer can make progress `error` holds a `PipelineError` that ends the run.
- Every control message, however malformed, is answered or dropped and counted; if any task of this
  thread dies, `error` says so and the trainer stops instead of running deaf.

Who may connect at all is settled before either loop sees a byte (shared/sockets.py). Within that, a
producer leaves when its control connection has closed (consumer/connections.py) or it has been silent for
HOLDER_SILENCE seconds, and each new holder of a shard gets a fresh lease with its welcome: data without
the current holder's lease is dropped (counted as stale `not_holder`) before anything else looks at it, so
it is never trained, never ends a stream, and never counts as a gap or a rejected batch that would make
the holder rewind. The old holder's batches already accepted are trained in order; the new holder's
copies of them (the same batches: a shard's stream is deterministic) are dropped as duplicates.

Consumption state lives in `WorkerTable` (one `WorkerState` per shard; "worker" is the wire's name for a
shard), shared with the step loop under a lock: the receive thread reads it to answer hellos and to drop
duplicates early; the step loop writes it as batches are trained on.
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

from lmpipe.consumer.assign import Producer, balance, shard_list
from lmpipe.consumer.connections import ControlConnections
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, batch_from_message, batch_limits
from lmpipe.shared.config import PipelineConfig, mismatches
from lmpipe.shared.messages import ALIVE_SECONDS, HOLDER_SILENCE, STOP_GRACE
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.security import start_zap
from lmpipe.shared.sockets import TRAINER_CONTROL, TRAINER_DATA, endpoints, open_socket
from lmpipe.shared.wire import WIRE_VERSION, WireError, decode

log = logging.getLogger("lmpipe.trainer")

RESEND_TIMEOUT = 5.0  # a resend request not answered within this long may be repeated
MAX_RESENDS = 3  # resend requests at one position, without progress, before the worker is stopped
# The first assignment of a session waits for --producers producers, or this long after the first hello:
# producers started together (`lmpipe run`, compose, a restarted trainer's producers rejoining) then start
# on their own shards instead of taking them from the first one to arrive, which would waste its batches.
SETTLE_SECONDS = 2.0
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
    """One shard: what the trainer consumed of it, and who serves it now."""

    worker: int  # the shard
    cursor: Cursor = field(default_factory=Cursor)  # after the last consumed batch
    last_seq: int = 0  # last consumed sequence number
    finished: bool = False
    identity: bytes | None = None  # its holder's routing id (None: no producer serves it now)
    last_seen: float = 0.0  # its holder's last hello
    where: str = ""  # its holder, for logs
    failed: str = ""  # why this shard was stopped for good (a deterministic failure)
    # resend bookkeeping, receive thread only
    resend_at: int = -1  # last_seq when the last resend request went out
    resend_sent: float = 0.0
    resends: int = 0  # requests at resend_at so far
    answered_at: float = 0.0  # when seq resend_at + 1 arrived (accepted or not) after the request
    resend_due: str = ""  # why another request is wanted once the outstanding one times out
    rejected: dict[int, str] = field(default_factory=dict)  # seq -> why the receiver rejected it
    lease: str = ""  # the current holder's token (messages.Welcome.lease); new for every new holder


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

    def missing(self, now: float) -> list[int]:
        """Shards with no live producer that still have data to send."""
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
                f"checkpoint has {len(state)} shard cursors, this run has {len(self.workers)} shards"
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


class SkippedRecords:
    """The producers' skipped bad records per shard and reason (messages.Hello.skipped). Whoever reads a
    shard reads it in the same order from its epoch's start, so every holder's count is of the same records
    so far: the highest is what was read, however often the shard moved or a producer restarted, and
    whatever host and pid its producers had."""

    def __init__(self) -> None:
        self._highest: dict[tuple[int, str], int] = {}

    def update(self, skipped: dict[str, int], shards: int) -> bool:
        """Take one hello's or bye's counts ("<shard>:<reason>" -> n); True if any count rose."""
        rose = False
        for key, n in skipped.items():
            shard, _, reason = key.partition(":")
            if not (shard.isdigit() and int(shard) < shards and reason and n >= 0):
                continue  # not a count of one of this session's shards
            at = (int(shard), _printable(reason, 40))
            if n > self._highest.get(at, 0):
                self._highest[at], rose = n, True
        return rose

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, reason), n in self._highest.items():
            out[reason] = out.get(reason, 0) + n
        return out


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
        *,
        data_content: str = "",
        data_versions: list[str] | None = None,
    ):
        super().__init__(name="lmpipe-receiver", daemon=True)
        self.cfg, self.slots, self.table = cfg, slots, table
        # the trainer's own dict: the first producer pins "data" (unless given) for checkpoints too
        self.fingerprint = fingerprint
        self.metrics, self.session, self.vocab_size = metrics, session, vocab_size
        # the corpus files' contents (a hello's `data_content`): given (the trainer's --data, a resumed
        # checkpoint's header) or pinned by the first producer that sends one; "": none yet
        self.data_content = data_content
        # remote objects' versions (a hello's `data_versions`), one pin per location (the objects' URLs): given
        # (the trainer's --data, a resumed checkpoint's header) or pinned by the first producer reading them
        self.data_versions = {messages.version_location(v): v for v in data_versions or []}
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
        # Producers in join order; a producer is gone once its connection closed or it was silent for
        # HOLDER_SILENCE (being silent for ALIVE_SECONDS, a stopped or busy process, is not enough).
        self.producers: dict[bytes, Producer] = {}
        self._joined = 0  # producers welcomed in this session: names p0, p1, ...
        self._skipped = SkippedRecords()
        self.skipped: dict[str, int] = {}  # bad records the producers skipped, by reason
        self._stopped: set[bytes] = set()  # producers refused for good; their hellos are refused again
        self._first_hello: float | None = None  # of this session; shards are assigned once settled
        self._settled = False
        self._stop_reason = ""
        self._awaiting_bye: dict[bytes, str] = {}  # identity -> "p1 (host:pid)" told to stop, not yet gone
        self._all_said_bye: asyncio.Event | None = None
        for w in range(len(table)):
            metrics.stream_resets.labels(str(w))
        self._publish()  # every open shard is unserved until producers come (the ShardsUnserved alert)

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

    def connected(self, now: float) -> int:
        """Producers heard from in the last ALIVE_SECONDS (any thread: reads a snapshot)."""
        return sum(1 for p in list(self.producers.values()) if now - p.last_seen < ALIVE_SECONDS)

    def stop(self, reason: str = "") -> None:
        """Tell every producer to stop (when `reason` is given), close the sockets, end the thread."""
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._shutdown, reason)
        except RuntimeError:  # the loop closed in between (the thread failed)
            return
        self.join(timeout=STOP_GRACE + 5)  # it waits up to STOP_GRACE for the producers' `bye`
        if self.is_alive():
            log.warning("the receive thread did not finish within %.0f s of the stop", STOP_GRACE + 5)

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
        # Bounded: a task cancelled in the middle of a ZeroMQ receive has been seen to take 25 s to end
        # (once in ~10 runs of 6 producers); closing the sockets below ends it in any case.
        _, late = await asyncio.wait([*tasks, stopping], timeout=1.0)
        if late:
            log.debug("receive tasks still ending after the stop: %s", ", ".join(t.get_name() for t in late))
        pull.disable_monitor()
        monitor.close(0)
        pull.close(0)
        router.close(linger=500)  # let the stop messages out
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)  # term, and close whatever socket a cancelled task may have left open
        ep.release()

    def _shutdown(self, reason: str) -> None:
        assert self._stopping is not None
        if self._stopping.is_set():
            return
        self._stop_reason = reason
        if reason and self._router is not None:
            for p in self.producers.values():
                self._send(p.identity, messages.Stop(reason))
                # Every open connection, not only producers heard from lately: behind a congested link
                # a live producer's hellos arrive late. A dead one's connection closes (heartbeats).
                self._awaiting_bye[p.identity] = p.label()
                log.debug("told producer %s to stop", p.label())
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
                self._reject("bad_worker", f"shard {worker} but this run has {len(self.table)} shards")
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
            slot = await self._free_slot()
            if slot is None:  # the run is over: nothing more is trained
                continue
            slot.fill(batch, worker, hdr["seq"], hdr["session"], now)
            del msg, batch, frames  # release the ZeroMQ buffers before waiting again
            self.ready.put(slot)
            self.metrics.ready_slots.set(self.ready.qsize())

    async def _free_slot(self) -> HostSlot | None:
        """A free host slot; None once the trainer is stopping. While it waits for the producers' `bye`
        the step loop takes no more batches, and the data socket must still be read: a producer whose
        connection is stuck halfway through a batch when it closes its socket trips a libzmq assertion
        (session_base.cpp, "Resource temporarily unavailable") and aborts instead of exiting 0."""
        assert self._free is not None and self._stopping is not None
        if not self._free.empty():
            return self._free.get_nowait()
        if self._stopping.is_set():
            return None
        get = asyncio.ensure_future(self._free.get())
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if get.done():
            return get.result()
        get.cancel()
        return None

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
                if self._stopping is not None and self._stopping.is_set():
                    continue  # producers leave because the run ends: nothing to report
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
            "shard %d %s, expected %d: asking it to resend (%d/%d)",
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
        """Stop a shard for good. Its producer is refused (it exits 2 with the reason) and never let back
        in this session; its other shards go to the other producers."""
        w = self.table[worker]
        if w.failed:
            return
        w.failed = reason
        self.metrics.workers_failed.set(sum(1 for x in self.table.workers if x.failed))
        log.error("stopped shard %d: %s. %s", worker, reason, ADVICE)
        p = self.producers.get(w.identity) if w.identity is not None else None
        if p is not None:
            self._stopped.add(p.identity)
            self._send(
                p.identity,
                messages.Refuse(f"the trainer stopped shard {worker}: {reason}. {ADVICE}"),
            )
            self._leave(p, f"stopped with shard {worker}")

    def _no_progress(self) -> PipelineError | None:
        failed = [w for w in self.table.workers if w.failed]
        if failed and all(w.finished or w.failed for w in self.table.workers):
            return PipelineError(
                "no producer can make progress: "
                + "; ".join(f"shard {w.worker}: {w.failed}" for w in failed)
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
                self.session,
                worker,
                w.cursor.to_dict(),
                w.last_seq + 1,
                force,
                lease=w.lease,
                shards=len(self.table),
            )
        self._send(w.identity, welcome)

    def _send_assign(self, p: Producer) -> None:
        self._send(
            p.identity,
            messages.Assign(self.session, sorted(p.shards), len(self.table), len(self.producers)),
        )

    def _tick(self) -> None:
        now = time.monotonic()
        if not self._settled and self._first_hello is not None and now - self._first_hello >= SETTLE_SECONDS:
            self._settle()
        for p in list(self.producers.values()):
            if now - p.last_seen > HOLDER_SILENCE:
                self._leave(p, f"silent for {now - p.last_seen:.0f} s")
        if self._stopping is None or not self._stopping.is_set():  # frozen once the run is over: the
            self.metrics.producers.set(self.connected(now))  # last scrape shows who served it to the end

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
        """A control connection closed: its producer is gone and its shards go to the others."""
        for p in list(self.producers.values()):
            if p.fd == fd:
                self._said_bye(p.identity)  # gone is as good as a `bye` to a stopping trainer
                self._leave(p, "connection closed")

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
            self._send(identity, messages.Refuse(f"malformed control message: {exc.detail}"))
            return
        if self._stopping is not None and self._stopping.is_set():
            if isinstance(msg, messages.Bye):
                self._count_skipped(msg.skipped)  # from a producer that has left too: its shards' counts
                self._said_bye(identity)
            elif isinstance(msg, messages.Hello) and self._stop_reason:  # the first stop is still on its way
                self._count_skipped(msg.skipped)  # or a stopping producer's last counts, before its bye
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
        if hello.wire != WIRE_VERSION:  # its batches would all be rejected: say so now, not after the first
            return self._refuse(identity, where, _version_skew(hello.wire), "wire_version")
        if identity in self._stopped:
            failed = [w for w in self.table.workers if w.failed]
            why = failed[0].failed if failed else "stopped"
            return self._refuse(identity, where, f"this producer was stopped: {why}", "worker_stopped")
        p = self.producers.get(identity)
        if p is not None:  # a heartbeat, or a known producer that lost and regained its connection
            p.last_seen, p.fd = now, fd
            self._count_skipped(hello.skipped)
            for s in p.shards:
                self.table[s].last_seen = now
            return self._reconcile(p, hello)
        pinned = bool(self.fingerprint.get("data"))
        diff = mismatches(self.fingerprint, hello.fingerprint, skip=() if pinned else ("data",))
        if diff:
            return self._refuse(identity, where, "config mismatch: " + "; ".join(diff), "config_mismatch")
        if self.data_content and hello.data_content and hello.data_content != self.data_content:
            return self._refuse(identity, where, _other_content(hello.data_content, self.data_content),
                                "config_mismatch")  # fmt: skip
        where_versions = messages.version_location(hello.data_versions)
        versions = self.data_versions.get(where_versions) if hello.data_versions else None
        if versions and versions != hello.data_versions:
            return self._refuse(
                identity, where, _other_versions(hello.data_versions, versions), "config_mismatch"
            )
        if hello.data_versions and not versions:  # the first producer reading these objects pins them
            self.data_versions[where_versions] = hello.data_versions
        if not pinned:
            self.fingerprint["data"] = hello.fingerprint.get("data", "")  # the first producer pins the corpus
        if not self.data_content:
            self.data_content = hello.data_content  # and the first that says it, the files' contents
        p = Producer(identity, f"p{self._joined}", where, hello.worker, fd, now)
        self._count_skipped(hello.skipped)
        self._joined += 1
        self.producers[identity] = p
        self.metrics.producer_joins.inc()
        if not self._settled:
            self._first_hello = self._first_hello or now
            if len(self.producers) >= self.cfg.producers or now - self._first_hello >= SETTLE_SECONDS:
                self._settle()
            return
        moved = self._rebalance()
        if not p.shards:
            self._send_assign(p)  # its welcome: it stands by
        log.info(
            "producer %s joined from %s: holds shards %s%s (%d producers, %d shards)",
            p.name,
            where,
            shard_list(p.shards),
            _taken(moved, p),
            len(self.producers),
            len(self.table),
        )

    def _count_skipped(self, skipped: dict[str, int]) -> None:
        if self._skipped.update(skipped, len(self.table)):
            self.skipped = self._skipped.by_reason()  # replaced whole: the training thread reads it as is

    def _settle(self) -> None:
        """The session's first assignment, to every producer that has said hello so far."""
        self._settled = True
        self._rebalance()
        for p in self.producers.values():
            if not p.shards:
                self._send_assign(p)
            log.info(
                "producer %s joined from %s: holds shards %s (%d producers, %d shards)",
                p.name,
                p.where,
                shard_list(p.shards),
                len(self.producers),
                len(self.table),
            )

    def _reconcile(self, p: Producer, hello: messages.Hello) -> None:
        """Answer what the producer's hello shows it lacks: a lost or late assign or welcome heals here.
        Both are idempotent on the producer's side (a welcome it already follows, same lease, is ignored)."""
        if not self._settled:
            return
        if hello.session != self.session or hello.rejoin:  # it has not seen this session's answer yet
            self._send_assign(p)
            for s in sorted(p.shards):
                if not self.table[s].finished:
                    self._send_welcome(s)
            return
        held = set(hello.holding)
        if held - p.shards:
            self._send_assign(p)
        for s in sorted(p.shards - held):
            if not (self.table[s].finished or self.table[s].failed):
                self._send_welcome(s)

    def _leave(self, p: Producer, why: str) -> None:
        if self.producers.pop(p.identity, None) is None:
            return
        self.metrics.producer_leaves.inc()
        if self._stopping is not None and self._stopping.is_set():
            return  # the run is over: nothing to hand on
        if not self._settled:  # it held nothing yet
            log.info("producer %s (%s) left (%s) before shards were assigned", p.name, p.where, why)
            return
        for s in p.shards:
            w = self.table[s]
            if w.identity == p.identity:
                w.identity, w.where = None, ""
        moved = self._rebalance()
        to = ", ".join(f"{s}->{q.name}" for s, (q, _) in sorted(moved.items()))
        log.info(
            "producer %s (%s) left (%s): shards %s %s (%d producers, %d shards)",
            p.name,
            p.where,
            why,
            shard_list({s for s in p.shards if not (self.table[s].finished or self.table[s].failed)}),
            f"moved {to}" if to else "wait for a producer" if not self.producers else "needed no move",
            len(self.producers),
            len(self.table),
        )

    def _rebalance(self) -> dict[int, tuple[Producer, str]]:
        """Re-divide the open shards over the producers (consumer/assign.py); tell every producer whose
        set changed, and welcome each shard at its new holder with a new lease. Returns, for the shards
        that changed hands, shard -> (new holder, old holder's name or "")."""
        open_shards = {w.worker for w in self.table.workers if not (w.finished or w.failed)}
        new = balance({k: p.shards for k, p in self.producers.items()}, open_shards)
        before = {s: p.name for p in self.producers.values() for s in p.shards}
        moved: dict[int, tuple[Producer, str]] = {}
        changed = []
        for k, p in self.producers.items():
            if new[k] != p.shards:
                for s in new[k] - p.shards:
                    moved[s] = (p, before.get(s, ""))
                p.shards = new[k]
                changed.append(p)
        for s, (p, _) in moved.items():
            w = self.table[s]
            w.identity, w.last_seen, w.where = p.identity, p.last_seen, p.label()
            w.lease = secrets.token_hex(16)  # the previous holder's batches in flight are now stale
        for p in changed:
            self._send_assign(p)
        for s in sorted(moved):
            self._send_welcome(s)
        self._publish()
        return moved

    def _publish(self) -> None:
        loads = [len(p.shards) for p in self.producers.values()]
        self.metrics.producers.set(self.connected(time.monotonic()))
        self.metrics.shards_per_producer.labels("min").set(min(loads, default=0))
        self.metrics.shards_per_producer.labels("max").set(max(loads, default=0))
        self.metrics.shards_unserved.set(
            sum(1 for w in self.table.workers if w.identity is None and not (w.finished or w.failed))
        )

    def _refuse(self, identity: bytes, where: str, reason: str, code: str) -> None:
        self.metrics.refuse(code)  # a REFUSAL_REASONS code; also counted as a rejected message (handshake)
        # once a minute per peer: a misconfigured producer exits, but a buggy or hostile one may not
        self._quiet(logging.ERROR, f"refuse {where}", "refused producer at %s: %s", where, _printable(reason))
        self._send(identity, messages.Refuse(reason))


def _other_content(theirs: str, ours: str) -> str:
    """The refusal of a producer whose corpus files match `data` (names and sizes) but not in content."""
    return (
        f"config mismatch: data_content: the producer's corpus files have the same names and sizes but other "
        f"content (producer has {_printable(theirs, 40)!r}, trainer has {ours!r}); serve the same files"
    )


def _other_versions(theirs: str, ours: str) -> str:
    """The refusal of a producer reading the run's remote objects after one of them changed."""
    return (
        f"config mismatch: data_versions: the producer's corpus objects have the same names and sizes but other "
        f"versions in their store (producer has {_printable(theirs, 60)!r}, trainer has {ours!r}): an object "
        f"was rewritten since the run began; serve the objects it was trained on"
    )


def _version_skew(wire: int) -> str:
    """The refusal of a producer of another wire version, naming both."""
    theirs = f"wire version {wire}" if wire else "wire version 2 or older (its hello names none)"
    return (
        f"wire version mismatch: the producer speaks {theirs}, the trainer speaks wire version "
        f"{WIRE_VERSION}; run the same lmpipe version on both sides"
    )


def _taken(moved: dict[int, tuple[Producer, str]], p: Producer) -> str:
    """' (from p0, p1)' for a join line: whom its shards came from."""
    src = sorted({old for new, old in moved.values() if new is p and old})
    return f" (from {', '.join(src)})" if src else ""
