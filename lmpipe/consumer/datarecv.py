"""The data socket: every message a producer pushes, decoded, judged and copied into a free host slot.

Each message is decoded and validated (shared/wire.py) before anything trusts a byte; what is malformed is
dropped and counted by reason. The ledger (consumer/ledger.py) says whether a batch can still be used: one
of an old session or without its shard's current lease is dropped (counted as stale) before anything else
looks at it, so it never counts as a gap or a rejected batch that would make the holder rewind; a
duplicate is dropped once it is known to be well-formed. The rest goes into a free host slot, handed to the
step loop through `ready`. With no free slot the loop stops reading, ZeroMQ's queues fill up and the
producers block: backpressure all the way back to the tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmpipe.consumer import ledger as verdicts
from lmpipe.consumer.connections import ControlConnections, DataPeers
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.quiet import Quiet, Rejects
from lmpipe.consumer.resends import Resends
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared.batch import Cursor, batch_from_message, batch_limits
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.wire import WireError, decode

log = logging.getLogger("lmpipe.trainer")


@dataclass
class EndOfStream:
    shard: int
    seq: int
    cursor: Cursor
    session: str
    received_at: float = 0.0


class DataReceiver:
    def __init__(
        self,
        cfg: PipelineConfig,
        ledger: Ledger,
        metrics: TrainerMetrics,
        vocab_size: int,
        resends: Resends,
        rejects: Rejects,
    ):
        self.cfg, self.ledger, self.metrics, self.vocab_size = cfg, ledger, metrics, vocab_size
        self.resends, self._reject = resends, rejects
        # Slots and ends, in arrival order, for the step loop. A SimpleQueue: its get() and put() are C, and
        # no Python code runs while they hold a lock. queue.Queue's get() takes its lock in
        # Condition.__enter__, Python code, where a Ctrl-C (KeyboardInterrupt in a library user's loop) can
        # land after the lock is taken and before the `with` that gives it back; the lock then stays held,
        # the receive thread's next put() blocks its loop for good, and the stop never reaches the producers
        # (a Loader's `with` hung on Ctrl-C).
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        # What a valid batch can hold, not a constant: the same function the tests check batches against.
        self.limits = batch_limits(cfg.batch_size, cfg.seq_len)
        # ZeroMQ cuts a connection that sends a bigger frame (a memory guard; counted as a disconnect).
        # Frames between the exact limit and this are read, then rejected and counted as oversized.
        self.max_frame = 4 * self.limits.max_frame_bytes + (1 << 20)
        self._quiet = Quiet()
        self.peers = DataPeers()  # which data connections are authenticated producers

    def _origin(self, hdr: Any) -> tuple[int, int] | None:
        """The shard of this session and the seq a message's header names, if it names them and carries
        that shard's current lease (only then may a rejected batch ask for a resend)."""
        if not isinstance(hdr, dict) or hdr.get("session") != self.ledger.session:
            return None
        shard, seq = hdr.get("shard"), hdr.get("seq")
        if type(shard) is not int or type(seq) is not int or not 0 <= shard < len(self.ledger):
            return None
        if hdr.get("lease") != self.ledger[shard].lease:
            return None
        return shard, seq

    def _rejected(self, exc: WireError, hdr: Any) -> None:
        """Drop a message and, when it is a batch of this session still wanted, get it sent again;
        a batch rejected a second time is a deterministic failure."""
        origin = self._origin(hdr)
        if origin is None:
            self._reject(exc.reason, exc.detail)
            return
        shard, seq = origin
        self._reject(exc.reason, f"shard {shard} seq {seq}: {exc.detail}")
        self.resends.arrived(shard, seq, time.monotonic())
        self.resends.rejected(shard, seq, f"{exc.reason}: {exc.detail}")

    async def recv_loop(self, pull: zmq.asyncio.Socket, free: asyncio.Queue, stopping: asyncio.Event) -> None:
        while True:
            try:
                frames = await pull.recv_multipart(copy=False)
            except zmq.Again:  # woken with nothing to read (seen while a CURVE handshake fails): go on
                continue
            now = time.monotonic()
            self.peers.delivered(ControlConnections.fd(frames[-1]))
            try:
                msg = decode(frames, self.limits)
            except WireError as exc:
                self._rejected(exc, exc.header)
                continue
            hdr = msg.header
            shard = hdr["shard"]
            if shard >= len(self.ledger):
                self._reject("bad_worker", f"shard {shard} but this run has {len(self.ledger)} shards")
                continue
            why = self.ledger.classify(shard, hdr["session"], hdr["seq"], hdr.get("lease"))
            if why in (verdicts.OLD_SESSION, verdicts.NOT_HOLDER):
                self.metrics.drop_stale(why)
                continue
            self.resends.arrived(shard, hdr["seq"], now)
            if msg.kind == "end":
                self.ready.put(
                    EndOfStream(shard, hdr["seq"], Cursor.from_dict(hdr["cursor"]), hdr["session"], now)
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
            if (
                why == verdicts.DUPLICATE
            ):  # a gap is the device feed's to judge: the missing batch may be queued
                self.metrics.drop_stale(why)
                continue
            self.metrics.received.labels(str(shard)).inc()
            slot = await _free_slot(free, stopping)
            if slot is None:  # the run is over: nothing more is trained
                continue
            slot.fill(batch, shard, hdr["seq"], hdr["session"], now)
            del msg, batch, frames  # release the ZeroMQ buffers before waiting again
            self.ready.put(slot)
            self.metrics.ready_slots.set(self.ready.qsize())

    async def monitor_loop(self, monitor: zmq.asyncio.Socket, stopping: asyncio.Event) -> None:
        """Counts authenticated producers' data connections that close: a producer that exited, or one
        ZeroMQ cut off for a frame over the size guard (the frame itself never reaches `decode`). A peer
        that never completed the handshake (a scanner, a client without the run's keys) is not counted."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.Again:
                continue
            if self.peers.event(event["event"], int(event["value"])):
                self.metrics.data_disconnects.inc()
                if stopping.is_set():
                    continue  # producers leave because the run ends: nothing to report
                self._quiet(
                    logging.INFO,
                    "disconnect",
                    "a producer's data connection closed (it exited, or sent a frame over %d bytes)",
                    self.max_frame,
                )


async def _free_slot(free: asyncio.Queue, stopping: asyncio.Event) -> HostSlot | None:
    """A free host slot; None once the trainer is stopping. While it waits for the producers' `bye`
    the step loop takes no more batches, and the data socket must still be read: a producer whose
    connection is stuck halfway through a batch when it closes its socket trips a libzmq assertion
    (session_base.cpp, "Resource temporarily unavailable") and aborts instead of exiting 0."""
    if not free.empty():
        return free.get_nowait()
    if stopping.is_set():
        return None
    get = asyncio.ensure_future(free.get())
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if get.done():
        return get.result()
    get.cancel()
    return None
