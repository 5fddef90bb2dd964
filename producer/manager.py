"""One producer process: handshake with the trainer, then tokenize, batch and stream until told to stop.

Sockets: a DEALER to the trainer's ROUTER for control, a PUSH to its PULL for data. The PUSH socket has a
small high-water mark, so when the trainer is slower than the producers, sends stop succeeding and the
producer stops making batches (its memory stays flat; the wait is counted as backpressure).

The loop polls both sockets, so a `welcome` naming a new session (the trainer restarted from a
checkpoint) or a `stop` is seen even while a batch waits to be sent. The hello is repeated every second
and doubles as a heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

import zmq

from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor, batch_bytes, end_frames, token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.log import setup as setup_log
from lmpipe.shared.metrics import ProducerMetrics, serve
from lmpipe.shared.security import client_sockets
from lmpipe.shared.tokenizer import load_tokenizer
from lmpipe.shared.wire import WireError

log = logging.getLogger("lmpipe.producer")

SEND_HWM = 4  # batches queued per producer before send blocks
HELLO_EVERY = 1.0


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
        self.metrics = ProducerMetrics()
        self.tok = load_tokenizer(cfg.tokenizer)
        self.corpus = Corpus(
            cfg.data,
            doc_split=cfg.doc_split,
            builtin_docs=cfg.builtin_docs,
            builtin_seed=cfg.seed,
            max_line_bytes=cfg.max_line_bytes,
            vocab_size=self.tok.vocab_size,
        )
        shards = self.corpus.shards
        if shards is not None and shards.meta["tokenizer_hash"] != self.tok.hash:
            raise ValueError(
                f"{shards.path} was prepared with tokenizer {shards.meta['tokenizer_hash']}, "
                f"this producer uses {self.tok.hash} ({self.tok.path}); pass the same --tokenizer or prepare again"
            )
        self.stream: DocStream | None = None
        self.spec = BatchSpec(
            strategy=cfg.strategy,
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            bucket_k=cfg.bucket_k,
            bucket_window=cfg.bucket_window,
            pad_multiple=cfg.pad_multiple,
            seed=cfg.seed,
        )
        self.dtype = token_dtype(self.tok.vocab_size)
        for m in (self.metrics.tokens, self.metrics.padding):
            m.labels(cfg.strategy)
        self.fingerprint = fingerprint(cfg, self.tok.hash, self.tok.vocab_size, self.corpus.fingerprint())
        self.session = ""
        self._stop = False
        self._docs_counted = 0
        self.interrupted = False
        self._end_cursor = Cursor()
        self._parent = os.getppid()
        if self.worker >= 0:
            self._assign(self.worker)

    def _assign(self, worker: int) -> None:
        self.worker = worker
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
                "data": self.corpus.describe()[:200],
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
        port = serve(self.metrics.registry, self.opts.metrics_port)
        if port is not None:
            log.info("worker %d metrics on :%d", self.worker, port)
        ctx = zmq.Context()
        ctrl = ctx.socket(zmq.DEALER)
        data = ctx.socket(zmq.PUSH)
        for s in (ctrl, data):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(
                zmq.IMMEDIATE, 1
            )  # queue only to live connections: a dead trainer's backlog is useless
        # No ZeroMQ heartbeats on the data socket: a trainer busy for seconds (or a starved CPU) must not
        # look dead and lose the batches queued on the connection. A crashed peer closes its TCP socket.
        ctrl.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        ctrl.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
        data.setsockopt(zmq.SNDHWM, SEND_HWM)
        # ZeroMQ's HWM counts messages in its own queues; the kernel's socket buffer holds more on top.
        # Keep that to a couple of batches too, so backpressure reaches the tokenizer quickly.
        data.setsockopt(zmq.SNDBUF, max(1 << 16, 2 * batch_bytes(self.cfg)))
        if self.cfg.curve_dir:
            client_sockets([ctrl, data], self.cfg.curve_dir)
        ctrl.connect(self.cfg.control_addr)
        data.connect(self.cfg.data_addr)
        try:
            return self._loop(ctrl, data)
        except Refused as exc:
            log.error("trainer refused this producer: %s", exc)
            return 2
        finally:
            ctrl.close(0)
            data.close(0)
            ctx.term()

    def _loop(self, ctrl: zmq.Socket, data: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        gen = None
        pending: list | None = None  # frames of the next message to send
        pending_since = 0.0
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
                if not self.session and now - waiting_logged > 10:
                    log.info("waiting for the trainer at %s (%.0f s)", self.cfg.control_addr, now - started)
                    waiting_logged = now
            if self.session and pending is None and not finished:
                t0 = time.perf_counter()
                try:
                    batch = next(gen)
                    seq += 1
                    pending = batch.to_frames(self.session, self.worker, seq)
                    self._count(batch)
                except StopIteration:
                    seq += 1
                    pending = end_frames(self.session, self.worker, seq, self._end_cursor)
                    finished = True
                    log.info(
                        "worker %d finished its %d epoch(s) after %d batches",
                        self.worker,
                        self.cfg.epochs,
                        seq - 1,
                    )
                log.debug("batch %d built in %.1f ms", seq, 1e3 * (time.perf_counter() - t0))
                pending_since = time.perf_counter()
            flags = dict(poller.poll(timeout=50 if pending is None else 0))
            if ctrl in flags:
                reset = self._control(ctrl.recv())
                if reset is not None:
                    cursor, next_seq = reset
                    if gen is not None:
                        gen.close()
                    gen = self._batches(cursor)
                    seq, pending, finished = next_seq - 1, None, False
                    continue
            if pending is not None and data.poll(timeout=50, flags=zmq.POLLOUT):
                try:
                    data.send_multipart(pending, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue  # the trainer went away between poll and send; keep the batch
                waited = time.perf_counter() - pending_since
                if waited > 0.001:
                    self.metrics.send_blocked.inc(waited)
                pending = None
                if not finished:
                    self.metrics.batches.inc()
        if self._parent_gone():
            log.warning("the launching process is gone; stopping")
        return 0

    def _batches(self, cursor: Cursor):
        self._end_cursor = Cursor(max(self.cfg.epochs, cursor.epoch))
        for b in batches(self.stream, self.spec, cursor, self.cfg.epochs, dtype=self.dtype):
            self._end_cursor = b.cursor
            yield b

    def _count(self, batch) -> None:
        m = self.metrics
        m.tokens.labels(self.cfg.strategy).inc(batch.real_tokens)
        m.padding.labels(self.cfg.strategy).inc(batch.pad_tokens)
        m.documents.inc(self.stream.stats.documents - self._docs_counted)
        self._docs_counted = self.stream.stats.documents
        m.cursor_pos.set(batch.cursor.pos)
        m.epoch.set(batch.cursor.epoch)

    def _control(self, raw: bytes) -> tuple[Cursor, int] | None:
        """Handle one control message; returns (cursor, next_seq) when the stream must restart."""
        try:
            msg = messages.unpack(raw)
        except WireError as exc:
            log.warning("ignoring malformed control message: %s", exc)
            return None
        if isinstance(msg, messages.Welcome):
            if msg.session == self.session and not msg.force:
                return None
            if self.worker < 0:
                self._assign(msg.worker)
                setup_log(f"producer {msg.worker}")
                log.info("the trainer assigned worker id %d of %d", msg.worker, self.cfg.producers)
            elif msg.worker != self.worker:
                log.warning("ignoring a welcome for worker %d (this is worker %d)", msg.worker, self.worker)
                return None
            first = not self.session
            self.session = msg.session
            self.metrics.handshakes.labels("welcome").inc()
            self.metrics.connected.set(1)
            cursor = Cursor.from_dict(msg.cursor)
            log.info(
                "%s session %s: starting at epoch %d doc %d offset %d skip %d, seq %d",
                "joined" if first else "trainer restarted; rejoined",
                msg.session,
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
            self.metrics.handshakes.labels("refuse").inc()
            if msg.retry:
                log.info("trainer asks to retry: %s", msg.reason)
                if self.opts.worker < 0 and self.worker >= 0:
                    # Another replica holds the id the trainer gave this one (it asked a restarted trainer
                    # first). Replicas are interchangeable: take any free id rather than wait for this one.
                    log.info("giving up worker id %d; asking the trainer for a free one", self.worker)
                    self.worker, self.session = -1, ""
                return None
            raise Refused(msg.reason)
        if isinstance(msg, messages.Stop):
            log.info("trainer says stop: %s", msg.reason or "run finished")
            self.metrics.connected.set(0)
            self._stop = True
        return None


def install_signal_handlers(p: Producer) -> None:
    signal.signal(signal.SIGTERM, p.request_stop)
    signal.signal(signal.SIGINT, p.request_stop)
