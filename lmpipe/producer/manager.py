"""One producer process: handshake with the trainer, then tokenize, batch and stream until told to stop.

Sockets (shared/sockets.py): a DEALER to the trainer's ROUTER for control, a PUSH to its PULL for data, whose
small high-water mark stops the producer when the trainer is slower (backpressure, counted). A monitor on
the control socket watches its handshakes: a refused key, or keys it lacks, make the producer exit saying why.

The trainer decides which shards this producer serves (`assign`; none: it stands by) and where each starts
(`welcome`, with the lease its batches carry); producer/held.py builds their batches round robin. The
control socket lives in a thread (producer/control.py) that says hello every second (the heartbeat, naming
the shards held) and hands the trainer's messages and connection events to the loop, which handles them in
order between batches. A stop (a signal, `stop` or `refuse`, the launcher gone) also sets a flag that the
tokenizer's calls and storage retries check, so the batch being built ends at once (never sent: cursors say
where each shard resumes). When the control connection drops, the producer holds its batches until a
trainer welcomes it again; a restarted trainer gets a new data connection too. A refusal is never retried
(exit 2). In a mixture (producer/corpora.py) each shard sends only as far as the trainer's credit goes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from lmpipe.producer import remote
from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.control import ControlChannel, Item
from lmpipe.producer.corpora import Corpora
from lmpipe.producer.held import HeldShard, Holdings
from lmpipe.producer.sources import BadRecords
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.batch import Batch, Cursor, token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.messages import HELLO_EVERY
from lmpipe.shared.metrics import serve, short_hash
from lmpipe.shared.metrics_producer import ProducerMetrics
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
    """Raised by Producer._check_stop, between the tokenizer's calls, once the producer is to stop."""


class Producer:
    def __init__(self, cfg: PipelineConfig, opts: ProducerOptions):
        if not -1 <= opts.worker < cfg.producers:
            raise ValueError(
                f"--worker {opts.worker} is outside 0..{cfg.producers - 1} (--producers {cfg.producers})"
            )
        self.cfg, self.opts = cfg, opts
        self.worker = opts.worker
        self.metrics = ProducerMetrics(cfg.strategy)  # labelled with its --worker number (and by shard)
        # the first few logged by line, all counted: this process's, each bad record once (trainer: the run's)
        self._bad = BadRecords(log, who="this producer")
        self._bad_read: dict[tuple[int, int, str], int] = {}  # (shards, shard, reason) -> most read here
        self.metrics.bind(self.worker)
        self._stopping = threading.Event()  # set by a stop from anywhere: ends tokenizing and storage waits
        self.waiting = ""  # what a storage retry waits for (the hellos say so), "" when none does
        remote.WAITS.spent = lambda seconds: self.metrics.storage_wait.inc(seconds)
        remote.WAITS.retrying = self._retrying
        remote.WAITS.sleep = self._storage_sleep
        mix = cfg.mixture()  # None: one corpus, as --data says
        self.tok = load_tokenizer(cfg.tokenizer, cfg.all_data())
        self.corpora = Corpora(cfg, self.tok.vocab_size, mix)  # a mixture's sources, or the one corpus
        self.corpus = self.corpora.corpora[0]
        self.corpora.check_prepared(self.tok)
        self.spec = BatchSpec.of(cfg)
        self.dtype = token_dtype(self.tok.vocab_size)
        # per shard, by reason, for the trainer's summary: what the shard's current stream has skipped
        self._skipped: dict[int, dict[str, int]] = {}
        self._skipped_sent: dict[str, int] = {}  # what the trainer was last told, "<shard>:<reason>" -> n
        # the last welcome's global shards (first, space: consumer/reshard.py); None: --rank of --world-size
        self._layout: tuple[int | None, int | None] = (None, None)
        self.holdings = Holdings(self._stream, self.spec, cfg.epochs, self.dtype, plan=self.corpora.plan)
        for m in (self.metrics.tokens, self.metrics.padding):
            m.labels(cfg.strategy)
        # every source's files (names and sizes), their contents as found, or the remote objects' versions
        self.fingerprint = fingerprint(cfg, self.tok.hash, self.tok.vocab_size, self.corpora.fingerprint())
        self.data_content = self.corpora.content_digest()
        self.data_versions = self.corpora.version_digest()
        self.session = ""
        check_connect(cfg.host, cfg.trusted_network, cfg.curve_dir)
        self.endpoints = endpoints(cfg)  # creates and checks the runtime directory (ValueError if unsafe)
        self._stop = False
        self._bye_due = False
        self.interrupted = False
        self._held = False  # the control connection dropped: send nothing until welcomed again
        self._channel: ControlChannel | None = None  # the control connection's thread while run() runs
        # what the hellos (built in that thread) say, as the loop last published it: (session, shards held)
        self._shown: tuple[str, list[int]] = ("", [])
        self._skipped_due: dict[str, int] = {}  # counts for the next hellos (_publish, _hello)
        self._lock = threading.Lock()  # guards _skipped_due
        self._pending: tuple[HeldShard, list, bool] | None = None  # the next message: shard, frames, is batch
        self._parent = os.getppid()
        self.metrics.info.info(
            {
                "producer": str(self.worker),
                "strategy": cfg.strategy,
                "tokenizer": self.tok.hash,
                "corpus": short_hash(self.corpora.fingerprint()),  # an id, not prose (the log describes it)
            }
        )

    def _stream(self, shard: int, total: int) -> DocStream:
        # a mixture's shard is its source's shard `local` of `per` (corpora.py); the one corpus's is itself
        source, local, per = self.corpora.locate(shard, total)
        first, shards = self._layout[0], self._layout[1] or per * self.cfg.world_size
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
            self.corpora.corpora[source],
            self.tok,
            local,
            per,
            rank=self.cfg.rank,
            world_size=self.cfg.world_size,
            first=first,
            space=shards,
            seed=self.corpora.seed(source),
            shuffle_window=self.cfg.shuffle_window,
            on_bad=bad_record,
            on_tokenize=self.metrics.tokenize.observe,
            keepalive=self._check_stop,
            scan=self.corpora.scan(source, shards),
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

    def _publish(self) -> None:
        """What the control thread's hellos say, from the loop (the only thread that changes it)."""
        self._shown = (self.session, self.holdings.held() if self.session else [])
        counts = self._skipped_counts()
        if counts:
            with self._lock:
                self._skipped_due.update(counts)

    def _hello(self, skipped: dict[str, int] | None = None) -> bytes:
        """A hello (the control thread's, or run()'s last ones with `skipped`), from what _publish left."""
        if skipped is None:
            with self._lock:
                keys = list(self._skipped_due)[: messages.SKIPPED_PER_MESSAGE]
                skipped = {k: self._skipped_due.pop(k) for k in keys}
        session, holding = self._shown
        channel = self._channel
        return messages.pack(
            messages.Hello(
                producer=self.worker,
                fingerprint=self.fingerprint,
                pid=os.getpid(),
                host=socket.gethostname(),
                session=session,
                rejoin=self._held or (channel is not None and channel.dropped),
                holding=holding,
                wire=WIRE_VERSION,
                skipped=skipped,
                data_content=self.data_content,
                data_versions=self.data_versions,
                waiting=self.waiting,
            )
        )

    def _check_stop(self) -> None:
        """Between the tokenizer's calls: _Stopping (the batch being built ends) once the producer is to stop."""
        if self._stop or self._stopping.is_set() or self._parent_gone():
            raise _Stopping

    def _retrying(self, what: str) -> None:
        self.waiting = what[:200]

    def _storage_sleep(self, seconds: float) -> None:
        """Between storage retries (the hellos go on meanwhile): a stop ends the sleep and the batch at once."""
        if self._stopping.wait(seconds) or self._stop:
            raise _Stopping

    def request_stop(self, signum=None, _frame=None) -> None:
        if signum is not None:
            log.info("%s: stopping", signal.Signals(signum).name)
            # a stop of its own (scale-down, Ctrl-C): the trainer counts it as a leave, not a loss
            self.interrupted = self._bye_due = True
        self._stop = True
        self._stopping.set()

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
        # The data socket has a context of its own, terminated before the `bye`: libzmq aborts (clean_pipes)
        # when a socket closed mid-batch sees the trainer close at once, and the bye lets the trainer close.
        self._open_data()
        self._publish()
        channel = self._channel = ControlChannel(
            ctrl,
            monitor,
            HandshakeWatch(ep),
            hello=lambda: self._hello(),  # looked up at each call (tests wrap it)
            serving=lambda: bool(self.session) and not self._held,
            parent_gone=self._parent_gone,
            stopping=self._stopping,
            every=HELLO_EVERY,
            waiting_for=ep.control,
        )
        channel.start()
        try:
            return self._loop(channel)
        except Refused as exc:
            log.error("trainer refused this producer: %s", exc)
            return 2
        except HandshakeFailed as exc:
            log.error("cannot connect: %s", exc)
            return 2
        finally:
            self._close_data()
            channel.finish(self._last_words() if self._bye_due else [])
            ctx.term()
            # the process's storage calls report to this producer no more
            remote.WAITS = remote.StorageWaits()

    def _last_words(self) -> list[bytes]:
        """The counts not yet told, in hellos, then the bye the trainer waits for before it closes its
        sockets (one connection: they arrive in order)."""
        self._publish()
        with self._lock:
            due, self._skipped_due = list(self._skipped_due.items()), {}
        k = messages.SKIPPED_PER_MESSAGE
        out = [self._hello(dict(due[i : i + k])) for i in range(0, len(due) - k, k)]
        last = due[len(out) * k :]
        return out + [messages.pack(messages.Bye(skipped=dict(last)))]

    def _open_data(self) -> None:
        self._data_ctx, self._reopen_data = zmq.Context(), False
        self._data = open_socket(self._data_ctx, PRODUCER_DATA, self.cfg, self.endpoints)

    def _close_data(self) -> None:
        self._data.close(0)
        self._data_ctx.term()  # returns once the data connection is torn down

    def _loop(self, channel: ControlChannel) -> int:
        self._pending = None
        blocked: float | None = None  # when the last poll for the data socket found it full
        while not self._stop and not self._parent_gone():
            if self._reopen_data:  # a new trainer: not one batch into the old one's connection
                self._close_data()
                self._open_data()
            if self._stopping.is_set():  # a stop or refusal the control thread read waits in its queue
                self._handle_all(channel)
                break
            self._publish()
            if self.session and self._pending is None and not self._held and channel.inbox.empty():
                try:
                    self._build()
                except _Stopping:  # the batch being built is dropped: nothing of it was sent
                    self._handle_all(channel)
                    break
            busy = not channel.inbox.empty() or (self._pending is not None and not self._held)
            item = channel.get(0 if busy else 0.05)
            if item is not None:
                self._handle(item)
                continue
            if self._pending is None or self._held:
                blocked = None
                continue
            # Counted as it accrues, so a stall shows in /metrics while it lasts, not when it ends; from the
            # end of the last poll on, so the loop's own turns between polls count too.
            t0 = time.perf_counter()
            writable = self._data.poll(timeout=50, flags=zmq.POLLOUT)
            now = time.perf_counter()
            self.metrics.send_blocked.inc(now - (t0 if blocked is None else blocked))
            blocked = None if writable else now
            if writable:
                _, frames, is_batch = self._pending
                try:
                    self._data.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue  # the trainer went away between poll and send; keep the batch
                self._pending = None
                if is_batch:
                    self.metrics.batches.inc()
        if self._parent_gone() or (self._channel is not None and self._channel.parent_lost):
            log.warning("the launching process is gone; stopping")
        return 0

    def _build(self) -> None:
        """Build the next message to send (the holdings' next batch or end) into _pending."""
        t0 = time.perf_counter()
        nxt = self.holdings.next_message(self.session)
        if nxt is None:
            return
        h, frames, batch = nxt
        self._pending = (h, frames, batch is not None)
        if batch is not None:
            self._count(h, batch)
        elif all(x.finished for x in self.holdings.shards.values()):
            log.info(
                "finished %s on shard(s) %s%s",
                self.corpora.finished_what(),
                ",".join(map(str, self.holdings.held())),
                # this process's count; the run's is the trainer's summary
                f"; {self._bad.summary()} in the shards it read (the trainer's summary counts the run's)"
                if self._bad.total
                else "",
            )
        log.debug("shard %d message %d built in %.1f ms", h.shard, h.seq, 1e3 * (time.perf_counter() - t0))

    def _handle_all(self, channel: ControlChannel) -> None:
        """Everything the control thread read so far, in order (a stop or refusal among it takes effect)."""
        while (item := channel.get(0)) is not None:
            self._handle(item)

    def _handle(self, item: Item) -> None:
        kind, what = item
        if kind == "error":
            raise what
        if kind == "msg":
            self._control(what)
        else:
            self._connection(what)

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
        m.sent(h.shard, batch.cursor.epoch, batch.cursor.pos)

    def _connection(self, event: Mapping[str, Any]) -> None:
        """One event of the control connection, in its place among the trainer's messages (the control
        thread logged a drop when it happened): a drop holds the batches until the trainer welcomes this
        producer again; a trainer (re)connected knows none of the counts."""
        if event["event"] == zmq.EVENT_DISCONNECTED and self.session:
            self._held = True
            self.metrics.connected.set(0)  # until a trainer welcomes it again
        elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._skipped_sent.clear()

    def _control(self, raw: bytes) -> None:
        """Handle one control message from the trainer."""
        try:
            msg = messages.unpack(raw)
        except WireError as exc:
            log.warning("ignoring malformed control message: %s", exc)
            return None
        if isinstance(msg, (messages.Assign, messages.Welcome)):
            held, self._held = self._held, False
            self.metrics.connected.set(1)
            if msg.session != self.session:  # joined, or the trainer restarted: nothing carries over
                # the session id is a capability on the data socket: named in no log (SECURITY.md)
                log.info("joined the trainer" if not self.session else "trainer restarted; rejoined it")
                # a trainer restarted while this producer was cut off leaves a data connection that looks
                # alive here: what is written into it (resends too) would be lost, so it starts anew
                self._reopen_data = bool(self.session)
                self.session = msg.session
                self.holdings.clear()
                self._skipped.clear()  # counts of the last session's shards (its split may differ)
                self._skipped_sent.clear()
                self._drop_pending()
                self.metrics.handshakes.labels("welcome").inc()
            elif held:
                log.info("the trainer welcomed this producer back; carrying on")
        if isinstance(msg, messages.Credit):  # a mixture's pacing: how far each shard may now send
            return self.holdings.grant(msg.grants) if msg.session == self.session else None
        if isinstance(msg, (messages.Assign, messages.Welcome)) and (why := self.corpora.split_problem(msg)):
            raise Refused(why)
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
        self.metrics.hold(msg.shards)
        if gone or new or not msg.shards:
            log.info(
                "the trainer assigned shards %s of %d%s (%d producers)",
                ",".join(map(str, msg.shards)) or "none (standing by)",
                msg.total,
                f"; gave up {','.join(map(str, gone))}" if gone else "",
                msg.producers,
            )

    def _welcomed(self, msg: messages.Welcome) -> None:
        if (msg.first, msg.space) != self._layout:  # other global shards: no stream carries over
            self.holdings.total, self._layout = 0, (msg.first, msg.space)
        h = self.holdings.shards.get(msg.shard)
        if h is not None and h.lease == msg.lease and not msg.force and self.holdings.total == msg.shards:
            if msg.credit is not None:
                self.holdings.grant({msg.shard: msg.credit})
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
        self.holdings.start(msg.shard, msg.shards, msg.lease, cursor, msg.next_seq, msg.credit)
        self.metrics.hold(self.holdings.assigned)
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
