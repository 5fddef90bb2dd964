"""The trainer's receive side: a thread running an asyncio loop (uvloop) over two ZeroMQ sockets.

- PULL (data): decode and validate each message, drop what is malformed (counted by reason), from an old
  session or already consumed (counted as stale), copy the rest into a free host slot and hand it to the
  step loop through `ready`. With no free slot the loop stops reading, ZeroMQ's queues fill up and the
  producers block: backpressure all the way back to the tokenizers.
- ROUTER (control): handshake. A producer's hello is checked against the trainer's fingerprint; the
  answer is `welcome` (session, cursor of the last batch consumed from that worker, next sequence
  number) or `refuse` with the reason. Hellos repeat every second and serve as heartbeats.

Consumption state lives in `WorkerTable`, shared with the step loop under a lock: the receive thread reads
it to answer hellos and to drop duplicates early; the step loop writes it as batches are trained on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from lmpipe.consumer.slots import HostSlot
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, batch_bytes, batch_from_message
from lmpipe.shared.config import PipelineConfig, mismatches
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.security import authorized_dir, server_sockets
from lmpipe.shared.wire import Limits, WireError, decode

log = logging.getLogger("lmpipe.trainer")

RECV_HWM = 4
ALIVE_SECONDS = 5.0


@dataclass
class WorkerState:
    worker: int
    cursor: Cursor = field(default_factory=Cursor)  # after the last consumed batch
    last_seq: int = 0  # last consumed sequence number
    finished: bool = False
    identity: bytes | None = None
    last_seen: float = 0.0
    where: str = ""


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

    def all_finished(self) -> bool:
        return all(w.finished for w in self.workers)

    def connected(self, now: float) -> int:
        return sum(1 for w in self.workers if w.identity is not None and now - w.last_seen < ALIVE_SECONDS)

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


@dataclass
class EndOfStream:
    worker: int
    seq: int
    cursor: Cursor
    session: str


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
        self.error: BaseException | None = None
        slot_bytes = cfg.batch_size * cfg.seq_len * 4
        self.limits = Limits(max_array_bytes=slot_bytes, max_dim=max(cfg.batch_size, cfg.seq_len))
        self._max_frame = 2 * slot_bytes + (1 << 20)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._free: asyncio.Queue | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._reject_logged: dict[str, int] = {}

    # -- called from the step loop's thread ---------------------------------------------------------

    def release(self, slot: HostSlot) -> None:
        """Give a slot back once nothing reads it any more."""
        slot.meta = None
        self._loop.call_soon_threadsafe(self._free.put_nowait, slot)

    def force_reset(self, worker: int) -> None:
        """Send a worker back to its consumed cursor (after a gap in its sequence numbers)."""
        self._loop.call_soon_threadsafe(self._send_welcome, worker, True)

    def stop(self, reason: str = "") -> None:
        """Tell every producer to stop (when `reason` is given), close the sockets, end the thread."""
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._shutdown, reason)
        self.join(timeout=5)

    # -- the thread ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            import uvloop

            uvloop.run(self._main())
        except ImportError:  # uvloop is Linux/macOS only; asyncio's loop does the same job more slowly
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced to the trainer through .error
            self.error = exc
            self.bound.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._free = asyncio.Queue()
        for s in self.slots:
            self._free.put_nowait(s)
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        router = ctx.socket(zmq.ROUTER)
        self._router = router
        for s in (pull, router):
            s.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.HEARTBEAT_IVL, 2000)  # not on the data socket; see producer/manager.py
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
        pull.setsockopt(zmq.RCVHWM, RECV_HWM)
        pull.setsockopt(zmq.RCVBUF, max(1 << 16, 2 * batch_bytes(self.cfg)))
        pull.setsockopt(zmq.MAXMSGSIZE, self._max_frame)  # a peer sending bigger frames is disconnected
        router.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        auth = None
        if self.cfg.curve_dir:
            try:
                auth = AsyncioAuthenticator(ctx)
                auth.start()
                auth.configure_curve(domain="*", location=authorized_dir(self.cfg.curve_dir))
                server_sockets([pull, router], self.cfg.curve_dir)
            except (OSError, ValueError) as exc:
                self.error = exc
                self.bound.set()
                ctx.destroy(0)
                return
        try:
            pull.bind(self.cfg.data_addr)
            router.bind(self.cfg.control_addr)
        except zmq.ZMQError as exc:
            self.error = OSError(f"cannot bind {self.cfg.data_addr} / {self.cfg.control_addr}: {exc}")
            self.bound.set()
            ctx.destroy(0)
            return
        self.bound.set()
        tasks = [asyncio.create_task(self._recv_loop(pull)), asyncio.create_task(self._control_loop(router))]
        await self._stopping.wait()
        # Closing right after the stop messages were queued lost them in tests (the data socket's
        # teardown raced the control socket's flush); a short drain makes their delivery reliable.
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pull.close(0)
        router.close(linger=500)  # let the stop messages out
        if auth is not None:
            auth.stop()
        ctx.term()

    def _shutdown(self, reason: str) -> None:
        if reason and self._router is not None:
            for w in self.table.workers:
                if w.identity is not None:
                    self._send(w.identity, messages.Stop(reason))
                    log.debug("told producer %d to stop", w.worker)
        self._stopping.set()

    # -- data ---------------------------------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        n = self._reject_logged.get(reason, 0) + 1
        self._reject_logged[reason] = n
        if n <= 5 or n % 1000 == 0:
            log.warning("dropped a message (%s, #%d): %s", reason, n, detail)

    async def _recv_loop(self, pull: zmq.asyncio.Socket) -> None:
        while True:
            frames = await pull.recv_multipart(copy=False)
            now = time.monotonic()
            try:
                msg = decode(frames, self.limits)
            except WireError as exc:
                self._reject(exc.reason, exc.detail)
                continue
            hdr = msg.header
            worker = hdr["worker"]
            if worker >= len(self.table):
                self._reject("bad_worker", f"worker {worker} but this run has {len(self.table)} producers")
                continue
            if hdr["session"] != self.session:
                self.metrics.stale.labels("old_session").inc()
                continue
            if msg.kind == "end":
                self.ready.put(
                    EndOfStream(worker, hdr["seq"], Cursor.from_dict(hdr["cursor"]), hdr["session"])
                )
                continue
            try:
                batch = batch_from_message(msg, self.vocab_size, self.cfg.seq_len, self.cfg.batch_size)
            except WireError as exc:
                self._reject(exc.reason, exc.detail)
                continue
            if hdr["strategy"] != self.cfg.strategy:
                self._reject(
                    "bad_batch", f"strategy {hdr['strategy']!r}, this run trains on {self.cfg.strategy!r}"
                )
                continue
            if hdr["seq"] <= self.table[worker].last_seq:
                self.metrics.stale.labels("duplicate").inc()
                continue
            self.metrics.received.labels(str(worker)).inc()
            slot = await self._free.get()
            slot.fill(batch, worker, hdr["seq"], hdr["session"], now)
            del msg, batch, frames  # release the ZeroMQ buffers before waiting again
            self.ready.put(slot)
            self.metrics.ready_slots.set(self.ready.qsize())

    # -- control ------------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Any) -> None:
        # NOBLOCK sends on an asyncio socket finish at once; a failure lands on the returned future.
        fut = self._router.send_multipart([identity, messages.pack(msg)], zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            log.debug(
                "control send failed: %s", fut.exception()
            )  # the producer went away; it says hello again

    def _send_welcome(self, worker: int, force: bool = False) -> None:
        w = self.table[worker]
        if w.identity is None:
            return
        with self.table.lock:
            welcome = messages.Welcome(self.session, worker, w.cursor.to_dict(), w.last_seq + 1, force)
        self._send(w.identity, welcome)

    async def _control_loop(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                identity, raw = await asyncio.wait_for(router.recv_multipart(), timeout=1.0)
            except TimeoutError:
                self.metrics.producers.set(self.table.connected(time.monotonic()))
                continue
            except ValueError:
                continue  # wrong number of frames
            try:
                msg = messages.unpack(raw)
            except WireError as exc:
                self._reject(exc.reason, exc.detail)
                continue
            if isinstance(msg, messages.Hello):
                self._hello(identity, msg)
            self.metrics.producers.set(self.table.connected(time.monotonic()))

    def _hello(self, identity: bytes, hello: messages.Hello) -> None:
        now = time.monotonic()
        where = f"{hello.host}:{hello.pid}"
        if hello.worker == -1:  # "any": the lowest id nobody holds (a replica of a scaled service)
            mine = [w.worker for w in self.table.workers if w.identity == identity]
            free = mine or [
                w.worker
                for w in self.table.workers
                if w.identity is None or now - w.last_seen >= ALIVE_SECONDS
            ]
            if not free:
                self._send(
                    identity, messages.Refuse(f"all {len(self.table)} worker ids are taken", retry=True)
                )
                return
            hello.worker = free[0]
        if not 0 <= hello.worker < len(self.table):
            reason = f"worker id {hello.worker} is outside 0..{len(self.table) - 1} (trainer runs {len(self.table)} producers)"
            return self._refuse(identity, where, reason)
        w = self.table[hello.worker]
        if hello.session == self.session and w.identity == identity:
            w.last_seen = now  # a heartbeat
            return
        pinned = bool(self.fingerprint.get("data"))
        diff = mismatches(self.fingerprint, hello.fingerprint, skip=() if pinned else ("data",))
        if not pinned and not diff:
            self.fingerprint["data"] = hello.fingerprint.get("data", "")  # the first producer pins the corpus
        if diff:
            return self._refuse(identity, where, "config mismatch: " + "; ".join(diff))
        if w.identity is not None and w.identity != identity and now - w.last_seen < ALIVE_SECONDS:
            self._send(
                identity,
                messages.Refuse(f"worker {hello.worker} is already connected from {w.where}", retry=True),
            )
            return
        w.identity, w.last_seen, w.where = identity, now, where
        self._send_welcome(hello.worker)
        log.info("producer %d joined from %s (resumes at seq %d)", hello.worker, where, w.last_seq + 1)

    def _refuse(self, identity: bytes, where: str, reason: str) -> None:
        log.error("refused producer at %s: %s", where, reason)
        self.metrics.rejected.labels("handshake").inc()
        self._send(identity, messages.Refuse(reason, retry=False))
