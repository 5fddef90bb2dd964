"""One producer process: handshake with the trainer, then tokenize, batch and stream until told to stop.

Sockets (made by shared/sockets.py): a DEALER to the trainer's ROUTER for control, a PUSH to its PULL for
data. The PUSH socket has a small high-water mark, so when the trainer is slower than the producers, sends
stop succeeding and the producer stops making batches (its memory stays flat; the wait is counted as
backpressure). A monitor on the control socket watches the connection and its handshakes: a trainer that
refuses this producer's key, or wants keys it lacks, makes it exit with the reason instead of waiting.

The trainer decides which shards of the corpus this producer serves (`assign`, possibly none: it stands
by) and where each starts (`welcome`, one per shard, with the lease its batches carry); producer/held.py
keeps them and builds their batches round robin. The loop polls both sockets, so an `assign` or
`welcome` (a shard moved to or away from this producer, the trainer restarted from a checkpoint) or a
`stop` is seen even while a batch waits to be sent. The hello is repeated every second, names the shards
held and doubles as a heartbeat, also while a long document is tokenized: the streams' keepalive sends it
between the tokenizer's calls, or the trainer would give this producer's shards away. A stop (a signal, the
trainer's `stop` or `refuse`) is taken there too, abandoning the batch being built (never sent: the trainer's
cursors say where each shard resumes); other control messages read there wait for the loop, which handles
them in order once the batch is built (the shards are mid-update until then). When the control connection
drops (the trainer died), the producer holds its batches until a trainer welcomes it again, instead of
streaming into a session that is gone; the hello goes out as soon as the connection is back. The keepalive
reads the connection's events too, so a long document does not hide them: the drop is logged when it
happens, and the hellos say `rejoin` from then on. An event that comes after a control message the
keepalive kept for the loop waits behind it, so the two take effect in the order they came.
A producer the trainer refuses (another wire version, another config, a stopped shard) exits 2 with the
reason at once: a refusal is never retried.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.held import HeldShard, Holdings
from lmpipe.producer.scan import SharedScan
from lmpipe.producer.shards import check_prepared_with
from lmpipe.producer.sources import BadRecords, Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.batch import Batch, Cursor, token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.messages import HELLO_EVERY
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
from lmpipe.shared.wire import WIRE_VERSION, WireError

log = logging.getLogger("lmpipe.producer")


@dataclass
class ProducerOptions:
    worker: int = -1  # this producer's number in logs (`lmpipe run` numbers its producers); -1: none
    metrics_port: int | None = None  # None: no metrics server; 0: any free port
    exit_with_parent: bool = False


class Refused(RuntimeError):
    pass


class _Stopping(Exception):
    """Raised by Producer._keepalive, inside the tokenizer, once the producer is to stop."""


class Producer:
    def __init__(self, cfg: PipelineConfig, opts: ProducerOptions):
        if not -1 <= opts.worker < cfg.producers:
            raise ValueError(
                f"--worker {opts.worker} is outside 0..{cfg.producers - 1} (--producers {cfg.producers})"
            )
        self.cfg, self.opts = cfg, opts
        self.worker = opts.worker
        self.metrics = ProducerMetrics(cfg.strategy)  # every series labelled with its --worker number
        # the first few logged by line, all counted: this process's, each bad record once (the trainer's
        # summary is the run's: each shard's highest count, from whichever producers read it)
        self._bad = BadRecords(log, who="this producer")
        self._bad_read: dict[tuple[int, int, str], int] = {}  # (shards, shard, reason) -> most read here
        self.metrics.bind(self.worker)
        self.tok = load_tokenizer(cfg.tokenizer, cfg.data)
        self.corpus = Corpus.of(cfg, self.tok.vocab_size)
        if self.corpus.shards is not None:
            check_prepared_with(self.corpus.shards, self.tok)
        self.spec = BatchSpec.of(cfg)
        self.dtype = token_dtype(self.tok.vocab_size)
        # per shard, by reason, for the trainer's summary: what the shard's current stream has skipped
        self._skipped: dict[int, dict[str, int]] = {}
        self._skipped_sent: dict[str, int] = {}  # what the trainer was last told, "<shard>:<reason>" -> n
        self._scan: SharedScan | None = None  # one read of the corpus for the shards held (scan.py)
        self.holdings = Holdings(self._stream, self.spec, cfg.epochs, self.dtype)
        for m in (self.metrics.tokens, self.metrics.padding):
            m.labels(cfg.strategy)
        self.fingerprint = fingerprint(cfg, self.tok.hash, self.tok.vocab_size, self.corpus.fingerprint())
        self.data_content = self.corpus.content_digest()  # the files' contents as found (hello, receiver.py)
        self.data_versions = self.corpus.version_digest()  # or the remote objects' versions
        self.session = ""
        check_connect(cfg.host, cfg.trusted_network, cfg.curve_dir)
        self.endpoints = endpoints(cfg)  # creates and checks the runtime directory (ValueError if unsafe)
        self._stop = False
        self._bye_due = False
        self.interrupted = False
        self._held = False  # the control connection dropped: send nothing until welcomed again
        self._ctrl: zmq.Socket | None = None  # the control socket while the loop runs (for _keepalive)
        self._monitor: zmq.Socket | None = None  # its monitor, and what reads the monitor's events (the same)
        self._watch: HandshakeWatch | None = None
        # control messages _keepalive read, and the connection's events read after them (event, when): the
        # loop handles them in order
        self._deferred: deque[bytes | tuple[Mapping[str, Any], float]] = deque()
        self._pending: tuple[HeldShard, list, bool] | None = None  # the next message: shard, frames, is batch
        self._last_hello = 0.0  # monotonic time of the last hello: the loop's and _keepalive's
        self._parent = os.getppid()
        self.metrics.info.info(
            {
                "worker": str(self.worker),
                "strategy": cfg.strategy,
                "tokenizer": self.tok.hash,
                "corpus": short_hash(self.corpus.fingerprint()),  # an id, not prose (the log describes it)
            }
        )

    def _stream(self, shard: int, total: int) -> DocStream:
        shards = total * self.cfg.world_size  # a stream's key in the scan is its global shard number
        if self._scan is None or self._scan.total != shards:  # a new split: nothing carries over
            self._scan = SharedScan(self.corpus, shards)
        counts = self._skipped[shard] = {}  # a new stream reads the shard again from its epoch's start

        def bad_record(reason: str, where: str, detail: str) -> None:
            counts[reason] = counts.get(reason, 0) + 1
            # the same records in the same order as any earlier stream of this shard here (one given up and
            # taken back, a new session's): this process's count and log take only those past its highest
            key = (shards, shard, reason)
            if counts[reason] > self._bad_read.get(key, 0):
                self._bad_read[key] = counts[reason]
                self._bad_record(reason, where, detail)

        return DocStream(
            self.corpus,
            self.tok,
            shard,
            total,
            rank=self.cfg.rank,
            world_size=self.cfg.world_size,
            seed=self.cfg.seed,
            shuffle_window=self.cfg.shuffle_window,
            on_bad=bad_record,
            on_tokenize=self.metrics.tokenize.observe,
            keepalive=self._keepalive,
            scan=self._scan,
        )

    # -- bookkeeping -------------------------------------------------------------------------------

    def _bad_record(self, reason: str, where: str, detail: str) -> None:
        self.metrics.bad_records.labels(reason).inc()
        self._bad(reason, where, detail)

    def _skipped_counts(self) -> dict[str, int]:
        """{"<shard>:<reason>": n} for messages.Hello.skipped: the counts that changed since the trainer was
        last told, at most SKIPPED_PER_MESSAGE of them (the trainer keeps each one's highest, so the rest
        go in the next heartbeats), so that a hello stays small with many shards and kinds of bad input."""
        out: dict[str, int] = {}
        for s, counts in self._skipped.items():
            for r, n in counts.items():
                key = f"{s}:{r}"
                if self._skipped_sent.get(key) != n and len(out) < messages.SKIPPED_PER_MESSAGE:
                    out[key] = self._skipped_sent[key] = n
        return out

    def _hello(self, skipped: dict[str, int] | None = None) -> bytes:
        return messages.pack(
            messages.Hello(
                producer=self.worker,
                fingerprint=self.fingerprint,
                pid=os.getpid(),
                host=socket.gethostname(),
                session=self.session,
                rejoin=self._held,
                holding=self.holdings.held() if self.session else [],
                wire=WIRE_VERSION,
                skipped=self._skipped_counts() if skipped is None else skipped,
                data_content=self.data_content,
                data_versions=self.data_versions,
            )
        )

    def _send_hello(self, ctrl: zmq.Socket, now: float) -> None:
        with contextlib.suppress(zmq.Again):  # no trainer connected yet
            ctrl.send(self._hello(), zmq.NOBLOCK)
        self._last_hello = now

    def _keepalive(self) -> None:
        """Between a stream's encode calls, which run inside the loop (same thread, same socket): the hello
        when one is due, so a long tokenization does not look like a producer gone, and a stop taken at once:
        _Stopping ends the batch being built (the loop stops). The trainer's `stop` and `refuse` are handled
        here; any other control message is kept for the loop, which handles it after the batch, in order.
        The connection's events are handled here as the loop handles them: a trainer gone is logged when it
        goes, and the batch being built is held; a trainer back gets a hello at once (saying `rejoin`);
        refusals make the producer give up. One read after a control message kept for the loop is kept too,
        behind it (_monitor_event)."""
        ctrl, monitor = self._ctrl, self._monitor
        if ctrl is not None:
            while monitor is not None and monitor.poll(0):
                self._monitor_event(monitor)
            now = time.monotonic()
            if now - self._last_hello >= HELLO_EVERY:
                self._send_hello(ctrl, now)
            while ctrl.poll(0):
                raw = ctrl.recv()
                try:
                    final = isinstance(messages.unpack(raw), (messages.Stop, messages.Refuse))
                except WireError:
                    final = False  # the loop's _control says so
                if final:
                    self._control(raw)  # sets _stop, or raises Refused
                    break  # (a stop repeated to the hellos meanwhile is not said twice)
                else:
                    self._deferred.append(raw)
        if self._stop or self._parent_gone():
            raise _Stopping

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
        serve(self.metrics.registry, self.opts.metrics_port, self.cfg.metrics_host)  # it logs where
        ctx = zmq.Context()
        ep = self.endpoints
        ctrl = open_socket(ctx, PRODUCER_CONTROL, self.cfg, ep, connect=False)
        # the monitor exists before the connection does, so not even the first handshake goes unseen
        monitor = ctrl.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
        ctrl.connect(ep.control)
        # The data socket has a context of its own, terminated before the `bye` goes out: libzmq aborts
        # (session_base.cpp, clean_pipes) when a socket closed mid-batch sees the trainer close the
        # connection at the same moment, and the bye is what lets the trainer close.
        data_ctx = zmq.Context()
        data = open_socket(data_ctx, PRODUCER_DATA, self.cfg, ep)
        try:
            return self._loop(ctrl, data, monitor)
        except Refused as exc:
            log.error("trainer refused this producer: %s", exc)
            return 2
        except HandshakeFailed as exc:
            log.error("cannot connect: %s", exc)
            return 2
        finally:
            self._ctrl = self._monitor = None  # no stream sends on it (or reads its monitor) from here on
            data.close(0)
            data_ctx.term()  # returns once the data connection is torn down
            if self._bye_due:  # the trainer waits for this before it closes its sockets
                # counts not yet told go first, in hellos (one connection: they arrive before the bye)
                counts = self._skipped_counts()
                with contextlib.suppress(zmq.Again):
                    while len(counts) == messages.SKIPPED_PER_MESSAGE:
                        ctrl.send(self._hello(counts), zmq.NOBLOCK)
                        counts = self._skipped_counts()
                with contextlib.suppress(zmq.Again):
                    ctrl.send(messages.pack(messages.Bye(skipped=counts)), zmq.NOBLOCK)
            ctrl.disable_monitor()
            monitor.close(0)
            ctrl.close(linger=1000)  # the bye just queued still goes out
            ctx.term()

    def _loop(self, ctrl: zmq.Socket, data: zmq.Socket, monitor: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        watch = HandshakeWatch(self.endpoints)
        self._pending = None
        self._ctrl, self._last_hello = ctrl, 0.0
        self._monitor, self._watch = monitor, watch  # read by the loop, and by _keepalive mid-document
        waiting_logged = 0.0
        started = time.monotonic()
        while not self._stop and not self._parent_gone():
            now = time.monotonic()
            if now - self._last_hello >= HELLO_EVERY:
                self._send_hello(ctrl, now)
                watch.stalled(now)  # connected, never authenticated: say why instead of waiting
                waiting = not self.session or self._held
                if waiting and now - waiting_logged > 10:
                    log.info("waiting for the trainer at %s (%.0f s)", self.endpoints.control, now - started)
                    waiting_logged = now
            if self.session and self._pending is None and not self._held and not self._deferred:
                t0 = time.perf_counter()
                try:
                    nxt = self.holdings.next_message(self.session)
                except _Stopping:  # the batch being built is dropped: nothing of it was sent
                    break
                if nxt is not None:
                    h, frames, batch = nxt
                    self._pending = (h, frames, batch is not None)
                    if batch is not None:
                        self._count(h, batch)
                    elif all(x.finished for x in self.holdings.shards.values()):
                        log.info(
                            "finished %s on shard(s) %s%s",
                            # --epochs 0 (until stopped) ends early only where the shards own no documents
                            f"its {self.cfg.epochs} epoch(s)"
                            if self.cfg.epochs
                            else "(its shards own no documents)",
                            ",".join(map(str, self.holdings.held())),
                            # this process's count; the run's is the trainer's summary
                            f"; {self._bad.summary()} in the shards it read (the trainer's summary "
                            "counts the run's)"
                            if self._bad.total
                            else "",
                        )
                    log.debug(
                        "shard %d message %d built in %.1f ms",
                        h.shard,
                        h.seq,
                        1e3 * (time.perf_counter() - t0),
                    )
            busy = self._deferred or (self._pending is not None and not self._held)
            flags = dict(poller.poll(timeout=0 if busy else 50))
            if monitor in flags:
                self._monitor_event(monitor)
                continue
            if self._deferred:  # read while the last batch was built: before any newer one, in order
                item = self._deferred.popleft()
                if isinstance(item, bytes):
                    self._control(item)
                else:
                    self._connection(*item)
                continue
            if ctrl in flags:
                self._control(ctrl.recv())
                continue
            if self._pending is None or self._held:
                continue
            # Counted as it accrues, so a stall shows in /metrics while it lasts, not when it ends.
            t0 = time.perf_counter()
            writable = data.poll(timeout=50, flags=zmq.POLLOUT)
            self.metrics.send_blocked.inc(time.perf_counter() - t0)
            if writable:
                _, frames, is_batch = self._pending
                try:
                    data.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue  # the trainer went away between poll and send; keep the batch
                self._pending = None
                if is_batch:
                    self.metrics.batches.inc()
        if self._parent_gone():
            log.warning("the launching process is gone; stopping")
        return 0

    def _drop_pending(self, shards: list[int] | None = None) -> None:
        """Forget the message waiting to be sent if it belongs to one of `shards` (None: any)."""
        if self._pending is not None and (shards is None or self._pending[0].shard in shards):
            self._pending = None

    def _count(self, h: HeldShard, batch: Batch) -> None:
        m = self.metrics
        m.tokens.labels(self.cfg.strategy).inc(batch.real_tokens)
        m.padding.labels(self.cfg.strategy).inc(batch.pad_tokens)
        m.documents.inc(h.stream.stats.documents - h.docs_counted)
        h.docs_counted = h.stream.stats.documents
        m.cursor_pos.set(batch.cursor.pos)
        m.epoch.set(batch.cursor.epoch)

    def _monitor_event(self, monitor: zmq.Socket) -> None:
        """Read one event of the control connection's monitor (the loop, and _keepalive mid-document): handled
        now, or, when control messages read before it wait in _deferred (a welcome read mid-document), kept
        behind them, so that the trainer's messages and the connection's events take effect in the order they
        came (a welcome from before a drop does not end the hold the drop began)."""
        event = parse_monitor_message(monitor.recv_multipart())
        if self._deferred:
            self._deferred.append((event, time.monotonic()))
        else:
            self._connection(event)

    def _connection(self, event: Mapping[str, Any], seen: float | None = None) -> None:
        """Handle one event of the control connection's monitor (`seen`: when it was read, if kept since)."""
        assert self._watch is not None  # set with the monitor
        self._watch(event)  # raises HandshakeFailed once the trainer keeps refusing this producer
        if self._connection_event(event, seen):
            self._last_hello = 0.0  # (re)connected: say hello now, not at the next tick
            self._skipped_sent.clear()  # a restarted trainer knows none of the counts

    def _connection_event(self, event: Mapping[str, Any], seen: float | None = None) -> bool:
        """Track the control connection; True when it is (back) up and a hello should go out now."""
        if event["event"] == zmq.EVENT_DISCONNECTED and self.session and not self._held:
            self._held = True
            ago = "" if seen is None else f" {time.monotonic() - seen:.1f} s ago, while a batch was built"
            log.info(
                "lost the connection to the trainer%s; holding batches until it welcomes this producer", ago
            )
        return event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def _control(self, raw: bytes) -> None:
        """Handle one control message from the trainer."""
        try:
            msg = messages.unpack(raw)
        except WireError as exc:
            log.warning("ignoring malformed control message: %s", exc)
            return None
        if isinstance(msg, (messages.Assign, messages.Welcome)):
            held, self._held = self._held, False
            if msg.session != self.session:  # joined, or the trainer restarted: nothing carries over
                # the session id is a capability on the data socket: named in no log (SECURITY.md)
                log.info("joined the trainer" if not self.session else "trainer restarted; rejoined it")
                self.session = msg.session
                self.holdings.clear()
                self._skipped.clear()  # counts of the last session's shards (its split may differ)
                self._skipped_sent.clear()
                self._drop_pending()
                self.metrics.handshakes.labels("welcome").inc()
                self.metrics.connected.set(1)
            elif held:
                log.info("the trainer welcomed this producer back; carrying on")
        if isinstance(msg, messages.Assign):
            return self._assigned(msg)
        if isinstance(msg, messages.Welcome):
            return self._welcomed(msg)
        if isinstance(msg, messages.Refuse):
            self.metrics.handshakes.labels("refuse").inc()
            raise Refused(msg.reason)
        if isinstance(msg, messages.Stop):
            self._bye_due = True  # sent once the data socket is closed (run)
            log.info("trainer says stop: %s", msg.reason or "run finished")
            self.metrics.connected.set(0)
            self._stop = True
        return None

    def _assigned(self, msg: messages.Assign) -> None:
        gone = self.holdings.keep_only(msg.shards)
        self._drop_pending(gone)
        new = [s for s in msg.shards if s not in self.holdings.shards]
        self.metrics.shards_held.set(len(msg.shards))
        if gone or new or not msg.shards:
            log.info(
                "the trainer assigned shards %s of %d%s (%d producers)",
                ",".join(map(str, msg.shards)) or "none (standing by)",
                msg.total,
                f"; gave up {','.join(map(str, gone))}" if gone else "",
                msg.producers,
            )

    def _welcomed(self, msg: messages.Welcome) -> None:
        h = self.holdings.shards.get(msg.shard)
        if h is not None and h.lease == msg.lease and not msg.force and self.holdings.total == msg.shards:
            return  # already serving it as told (a repeated welcome)
        cursor = Cursor.from_dict(msg.cursor)
        how = (
            "resending"
            if h is not None and h.lease == msg.lease
            else "starting"
            if h is None
            else "restarting"
        )
        self._drop_pending([msg.shard])
        self.holdings.start(msg.shard, msg.shards, msg.lease, cursor, msg.next_seq)
        self.metrics.shards_held.set(len(self.holdings))
        if h is not None:
            self.metrics.resets.inc()
        log.log(
            logging.INFO if how == "resending" else logging.DEBUG,
            "shard %d: %s at epoch %d doc %d offset %d skip %d, seq %d",
            msg.shard,
            "the trainer asked for a resend" if how == "resending" else how,
            cursor.epoch,
            cursor.pos,
            cursor.offset,
            cursor.skip,
            msg.next_seq,
        )


def install_signal_handlers(p: Producer) -> None:
    signal.signal(signal.SIGTERM, p.request_stop)
    signal.signal(signal.SIGINT, p.request_stop)
