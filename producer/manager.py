"""One producer process: handshake with the trainer, then tokenize, batch and stream until told to stop.

Sockets (made by shared/sockets.py): a DEALER to the trainer's ROUTER for control, a PUSH to its PULL for
data. The PUSH socket has a small high-water mark, so when the trainer is slower than the producers, sends
stop succeeding and the producer stops making batches (its memory stays flat; the wait is counted as
backpressure). A monitor on the control socket watches the connection and its handshakes: a trainer that
refuses this producer's key, or wants keys it lacks, makes it exit with the reason instead of waiting.

The loop polls both sockets, so a `welcome` naming a new session (the trainer restarted from a
checkpoint) or a `stop` is seen even while a batch waits to be sent. The hello is repeated every second
and doubles as a heartbeat. When the control connection drops (the trainer died), the producer holds its
batches until a trainer welcomes it again, instead of streaming its share into a session that is gone;
the hello goes out as soon as the connection is back. A producer the trainer keeps refusing with "retry"
(its worker id is held by a live producer, every id is taken) gives up after GIVE_UP_SECONDS and exits 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.batch import Batch, Cursor, end_frames, token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.log import setup as setup_log
from lmpipe.shared.messages import GIVE_UP_SECONDS, HELLO_EVERY
from lmpipe.shared.metrics import ProducerMetrics, serve, short_hash
from lmpipe.shared.security import check_connect
from lmpipe.shared.sockets import (
    HANDSHAKE_EVENTS,
    PRODUCER_CONTROL,
    PRODUCER_DATA,
    HandshakeFailed,
    HandshakeWatch,
    endpoints,
    open_socket,
)
from lmpipe.shared.tokenizer import load_tokenizer
from lmpipe.shared.wire import WireError

log = logging.getLogger("lmpipe.producer")


@dataclass
class ProducerOptions:
    worker: int = 0
    metrics_port: int | None = None  # None: no metrics server; 0: any free port
    exit_with_parent: bool = False


class Refused(RuntimeError):
    pass


class Producer:
    def __init__(self, cfg: PipelineConfig, opts: ProducerOptions):
        if not -1 <= opts.worker < cfg.producers:
            raise ValueError(
                f"--worker {opts.worker} is outside 0..{cfg.producers - 1} (--producers {cfg.producers})"
            )
        self.cfg, self.opts = cfg, opts
        self.worker = opts.worker  # -1 until the trainer assigns one
        self.auto = opts.worker == -1  # any id will do; the trainer may move this producer to another
        self.metrics = ProducerMetrics(cfg.strategy)  # every series labelled with the worker id held
        self.tok = load_tokenizer(cfg.tokenizer)
        self.corpus = Corpus.of(cfg, self.tok.vocab_size)
        shards = self.corpus.shards
        if shards is not None and shards.meta["tokenizer_hash"] != self.tok.hash:
            raise ValueError(
                f"{shards.path} was prepared with tokenizer {shards.meta['tokenizer_hash']}, "
                f"this producer uses {self.tok.hash} ({self.tok.path}); pass the same --tokenizer or prepare again"
            )
        self.stream: DocStream | None = None
        self.spec = BatchSpec.of(cfg)
        self.dtype = token_dtype(self.tok.vocab_size)
        for m in (self.metrics.tokens, self.metrics.padding):
            m.labels(cfg.strategy)
        self.fingerprint = fingerprint(cfg, self.tok.hash, self.tok.vocab_size, self.corpus.fingerprint())
        self.session = ""
        self.lease = ""  # the trainer's token for this holder of the worker id, stamped on every batch
        check_connect(cfg.host, cfg.trusted_network, cfg.curve_dir)
        self.endpoints = endpoints(cfg)  # creates and checks the runtime directory (ValueError if unsafe)
        self._stop = False
        self._docs_counted = 0
        self.interrupted = False
        self._held = False  # the control connection dropped: send nothing until welcomed again
        self._refused_since: float | None = None
        self._retry_logged = 0.0
        self._end_cursor = Cursor()
        self._parent = os.getppid()
        if self.worker >= 0:
            self._assign(self.worker)

    def _assign(self, worker: int) -> None:
        self.worker = worker
        self.metrics.bind(worker)
        self._docs_counted = 0  # documents of this stream already counted in the metric
        self.stream = DocStream(
            self.corpus,
            self.tok,
            worker,
            self.cfg.producers,
            rank=self.cfg.rank,
            world_size=self.cfg.world_size,
            seed=self.cfg.seed,
            shuffle_window=self.cfg.shuffle_window,
            on_bad=self._bad_record,
            on_tokenize=self.metrics.tokenize.observe,
        )
        self.metrics.info.info(
            {
                "worker": str(worker),
                "strategy": self.cfg.strategy,
                "tokenizer": self.tok.hash,
                "corpus": short_hash(self.corpus.fingerprint()),  # an id, not prose (the log describes it)
            }
        )

    # -- bookkeeping -------------------------------------------------------------------------------

    def _bad_record(self, reason: str, where: str, detail: str) -> None:
        self.metrics.bad_records.labels(reason).inc()
        log.warning("%s: %s (%s), skipped", where, detail, reason)

    def _hello(self) -> bytes:
        return messages.pack(
            messages.Hello(
                worker=self.worker,
                num_workers=self.cfg.producers,
                fingerprint=self.fingerprint,
                pid=os.getpid(),
                host=socket.gethostname(),
                session=self.session,
                auto=self.auto,
                rejoin=self._held,
            )
        )

    def request_stop(self, signum=None, _frame=None) -> None:
        if signum is not None:
            log.info("%s: stopping", signal.Signals(signum).name)
            self.interrupted = True
        self._stop = True

    def _parent_gone(self) -> bool:
        return self.opts.exit_with_parent and os.getppid() != self._parent

    # -- main loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Returns the process exit code: 0 after `stop` or a signal, 2 when refused."""
        port = serve(self.metrics.registry, self.opts.metrics_port, self.cfg.metrics_host)
        if port is not None:
            log.info("worker %d metrics on :%d", self.worker, port)
        ctx = zmq.Context()
        ep = self.endpoints
        ctrl = open_socket(ctx, PRODUCER_CONTROL, self.cfg, ep, connect=False)
        # the monitor exists before the connection does, so not even the first handshake goes unseen
        monitor = ctrl.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
        ctrl.connect(ep.control)
        data = open_socket(ctx, PRODUCER_DATA, self.cfg, ep)
        try:
            return self._loop(ctrl, data, monitor)
        except Refused as exc:
            log.error("trainer refused this producer: %s", exc)
            return 2
        except HandshakeFailed as exc:
            log.error("cannot connect: %s", exc)
            return 2
        finally:
            ctrl.disable_monitor()
            monitor.close(0)
            ctrl.close(linger=1000)  # a `bye` just queued still goes out
            data.close(0)
            ctx.term()

    def _loop(self, ctrl: zmq.Socket, data: zmq.Socket, monitor: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        watch = HandshakeWatch(self.endpoints)
        gen: Generator[Batch, None, None] | None = None
        pending: list | None = None  # frames of the next message to send
        seq = 0
        finished = False
        last_hello = 0.0
        waiting_logged = 0.0
        started = time.monotonic()
        while not self._stop and not self._parent_gone():
            now = time.monotonic()
            if now - last_hello >= HELLO_EVERY:
                with contextlib.suppress(zmq.Again):  # no trainer connected yet
                    ctrl.send(self._hello(), zmq.NOBLOCK)
                last_hello = now
                waiting = (not self.session or self._held) and self._refused_since is None
                if waiting and now - waiting_logged > 10:
                    log.info("waiting for the trainer at %s (%.0f s)", self.endpoints.control, now - started)
                    waiting_logged = now
            if self.session and pending is None and not finished and not self._held:
                t0 = time.perf_counter()
                assert gen is not None  # a session comes with a welcome, which starts the stream
                try:
                    batch = next(gen)
                    seq += 1
                    pending = batch.to_frames(self.session, self.worker, seq, self.lease)
                    self._count(batch)
                except StopIteration:
                    seq += 1
                    pending = end_frames(self.session, self.worker, seq, self._end_cursor, self.lease)
                    finished = True
                    log.info(
                        "worker %d finished its %d epoch(s) after %d batches",
                        self.worker,
                        self.cfg.epochs,
                        seq - 1,
                    )
                log.debug("batch %d built in %.1f ms", seq, 1e3 * (time.perf_counter() - t0))
            flags = dict(poller.poll(timeout=50 if pending is None or self._held else 0))
            if monitor in flags:
                event = parse_monitor_message(monitor.recv_multipart())
                watch(event)  # raises HandshakeFailed once the trainer keeps refusing this producer
                if self._connection_event(event):
                    last_hello = 0.0  # (re)connected: say hello now, not at the next tick
                continue
            if ctrl in flags:
                reset = self._control(ctrl.recv(), ctrl)
                if reset is not None:
                    cursor, next_seq = reset
                    if gen is not None:
                        gen.close()
                    gen = self._batches(cursor)
                    seq, pending, finished = next_seq - 1, None, False
                    continue
            if pending is None or self._held:
                continue
            # Counted as it accrues, so a stall shows in /metrics while it lasts, not when it ends.
            t0 = time.perf_counter()
            writable = data.poll(timeout=50, flags=zmq.POLLOUT)
            self.metrics.send_blocked.inc(time.perf_counter() - t0)
            if writable:
                try:
                    data.send_multipart(pending, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue  # the trainer went away between poll and send; keep the batch
                pending = None
                if not finished:
                    self.metrics.batches.inc()
        if self._parent_gone():
            log.warning("the launching process is gone; stopping")
        return 0

    def _batches(self, cursor: Cursor) -> Generator[Batch, None, None]:
        assert self.stream is not None  # assigned with the worker id
        self._end_cursor = Cursor(max(self.cfg.epochs, cursor.epoch))
        for b in batches(self.stream, self.spec, cursor, self.cfg.epochs, dtype=self.dtype):
            self._end_cursor = b.cursor
            yield b

    def _count(self, batch) -> None:
        m = self.metrics
        m.tokens.labels(self.cfg.strategy).inc(batch.real_tokens)
        m.padding.labels(self.cfg.strategy).inc(batch.pad_tokens)
        assert self.stream is not None
        m.documents.inc(self.stream.stats.documents - self._docs_counted)
        self._docs_counted = self.stream.stats.documents
        m.cursor_pos.set(batch.cursor.pos)
        m.epoch.set(batch.cursor.epoch)

    def _connection_event(self, event: Mapping[str, Any]) -> bool:
        """Track the control connection; True when it is (back) up and a hello should go out now."""
        if event["event"] == zmq.EVENT_DISCONNECTED and self.session and not self._held:
            self._held = True
            log.info("lost the connection to the trainer; holding batches until it welcomes this producer")
        return event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def _control(self, raw: bytes, ctrl: zmq.Socket) -> tuple[Cursor, int] | None:
        """Handle one control message; returns (cursor, next_seq) when the stream must restart."""
        try:
            msg = messages.unpack(raw)
        except WireError as exc:
            log.warning("ignoring malformed control message: %s", exc)
            return None
        if isinstance(msg, messages.Welcome):
            self._refused_since = None
            held, self._held = self._held, False
            moved = False
            if msg.worker != self.worker:
                if not self.auto:
                    log.warning(
                        "ignoring a welcome for worker %d (this is worker %d)", msg.worker, self.worker
                    )
                    return None
                moved = self.worker >= 0
                self._assign(msg.worker)
                setup_log(f"producer {msg.worker}")
                log.info(
                    "the trainer %s worker id %d of %d",
                    "moved this producer to" if moved else "assigned",
                    msg.worker,
                    self.cfg.producers,
                )
            elif msg.session == self.session and msg.lease == self.lease and not msg.force:
                if held:
                    log.info("the trainer welcomed this producer back; carrying on")
                return None
            if not self.session:
                how = "joined"
            elif moved:
                how = "moved to another worker id; starting over in"
            elif msg.session != self.session:
                how = "trainer restarted; rejoined"
            elif msg.lease != self.lease:
                how = "welcomed anew (the trainer had closed this producer's connection); resending in"
            else:
                how = "the trainer asked for a resend in"
            first = not self.session
            self.session, self.lease = msg.session, msg.lease
            self.metrics.handshakes.labels("welcome").inc()
            self.metrics.connected.set(1)
            cursor = Cursor.from_dict(msg.cursor)
            log.info(
                "%s session: starting at epoch %d doc %d offset %d skip %d, seq %d",
                how,
                cursor.epoch,
                cursor.pos,
                cursor.offset,
                cursor.skip,
                msg.next_seq,
            )
            if not first:
                self.metrics.resets.inc()
            return cursor, msg.next_seq
        if isinstance(msg, messages.Refuse):
            self.metrics.handshakes.labels("retry" if msg.retry else "refuse").inc()
            if not msg.retry:
                raise Refused(msg.reason)
            if self.auto and self.worker >= 0:
                # Another replica holds the id the trainer gave this one (it asked a restarted trainer first).
                # Replicas are interchangeable (the trainer keeps every cursor): take any free id instead.
                log.info("giving up worker id %d; asking the trainer for a free one", self.worker)
                self.worker, self.session = -1, ""
                self.metrics.bind(-1)
                return None
            now = time.monotonic()
            if self._refused_since is None:
                self._refused_since = now
            waited = now - self._refused_since
            if waited > GIVE_UP_SECONDS:
                raise Refused(f"{msg.reason} (still refused after {waited:.0f} s; giving up)")
            if now - self._retry_logged >= 5:
                log.info("trainer asks to retry: %s (gives up after %.0f s)", msg.reason, GIVE_UP_SECONDS)
                self._retry_logged = now
            return None
        if isinstance(msg, messages.Stop):
            with contextlib.suppress(zmq.Again):  # the trainer waits for this before it closes its sockets
                ctrl.send(messages.pack(messages.Bye()), zmq.NOBLOCK)
            log.info("trainer says stop: %s", msg.reason or "run finished")
            self.metrics.connected.set(0)
            self._stop = True
        return None


def install_signal_handlers(p: Producer) -> None:
    signal.signal(signal.SIGTERM, p.request_stop)
    signal.signal(signal.SIGINT, p.request_stop)
