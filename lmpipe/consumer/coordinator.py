"""The control side: the handshake with producers, who holds which shard, and producers' liveness.

A producer's hello (ROUTER, shared/messages.py) is checked against the trainer's fingerprint
(consumer/admission.py); a new producer is answered with `assign` (the shards it holds now, possibly none)
and one `welcome` per shard (session, shard, cursor of the last batch consumed from that shard, next
sequence number, lease), or `refuse` with the reason. Every join and every leave re-divides the open
shards (consumer/assign.py): a shard that changes hands gets a new lease, so its old holder's batches still
in flight are dropped (consumer/ledger.py), and its new holder starts after the last batch the trainer
accepted. Hellos repeat every second, serve as heartbeats and name the shards held; a difference is
answered again. The old holder's batches already accepted are trained in order; the new holder's copies of
them (the same batches: a shard's stream is deterministic) are dropped as duplicates.

Liveness: a producer leaves when its control connection has closed (consumer/connections.py) or it has
been silent for HOLDER_SILENCE seconds. A shard whose batches are rejected every time, or never arrive
intact (consumer/resends.py), is stopped for good: its producer is refused with the reason, and once no
producer can make progress `no_progress` says so and the run ends. Every control message, however
malformed, is answered or dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from lmpipe.consumer.admission import Admission, SkippedRecords, version_skew
from lmpipe.consumer.assign import Producer, balance, moved_to, producer_name, shard_list, taken_from
from lmpipe.consumer.connections import ControlConnections
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.quiet import Quiet, Rejects, printable
from lmpipe.consumer.resends import Resends
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.messages import ALIVE_SECONDS, HOLDER_SILENCE
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.wire import WIRE_VERSION, WireError

log = logging.getLogger("lmpipe.trainer")

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


# seconds a closed control connection's producer has for its bye to be read: the close comes from a monitor
# socket of its own, so the bye may still be queued behind it (counted as `bye`, not as lost)
BYE_GRACE = 0.5


class Coordinator:
    def __init__(
        self,
        cfg: PipelineConfig,
        ledger: Ledger,
        metrics: TrainerMetrics,
        admission: Admission,
        rejects: Rejects,
    ):
        self.cfg, self.ledger, self.metrics, self.admission = cfg, ledger, metrics, admission
        self._reject = rejects
        self.resends = Resends(ledger, metrics, lambda s: self._send_welcome(s, force=True), self.fail)
        self._quiet = Quiet()
        # Producers in join order; a producer is gone once its connection closed or it was silent for
        # HOLDER_SILENCE (being silent for ALIVE_SECONDS, a stopped or busy process, is not enough).
        self.producers: dict[bytes, Producer] = {}
        self._joined = 0  # producers welcomed in this session (assign.producer_name)
        self._skipped = SkippedRecords()
        self.skipped: dict[str, int] = {}  # bad records the producers skipped, by reason
        self._stopped: set[bytes] = set()  # producers refused for good; their hellos are refused again
        self._first_hello: float | None = None  # of this session; shards are assigned once settled
        self._settled = False
        self._router: zmq.asyncio.Socket | None = None
        self.stopping = asyncio.Event()  # set once the run is over (the receive thread's loop)
        self.stop_reason = ""
        self.awaiting_bye: dict[bytes, str] = {}  # identity -> "producer 1 (h:pid)" told to stop, not gone
        # a mixture's pacing (consumer/mixfeed.py): a holder may send this many messages of a shard past the
        # last consumed one; 0: no limit (welcomes carry credit None), a run without a mixture
        self.credit_window = 0
        self.all_said_bye = asyncio.Event()
        # identity -> (fd, when its connection closed): left as `closed` once BYE_GRACE passed without its bye
        self._closing: dict[bytes, tuple[int, float]] = {}
        for w in range(len(ledger)):
            metrics.stream_resets.labels(str(w))
        self._publish()  # every open shard is unserved until producers come (the ShardsUnserved alert)

    @property
    def session(self) -> str:
        return self.ledger.session

    def connected(self, now: float) -> int:
        """Producers heard from in the last ALIVE_SECONDS (any thread: reads a snapshot)."""
        return sum(1 for p in list(self.producers.values()) if now - p.last_seen < ALIVE_SECONDS)

    def wait_line(self, now: float) -> str:
        """What the step loop waits on, for its log line: who is connected, what connected producers say
        they wait on (storage retries: they send nothing meanwhile), and which shards nobody serves."""
        live = [p for p in list(self.producers.values()) if now - p.last_seen < ALIVE_SECONDS]
        parts = [f"{len(live)} producer(s) connected"]
        waiting = [f"{p.name} waiting on {p.waiting}" for p in live if p.waiting]
        if waiting:
            more = len(waiting) - 3
            parts.append("; ".join(waiting[:3]) + (f"; {more} more waiting" if more > 0 else ""))
        missing = self.ledger.missing(now)
        if missing:
            parts.append(f"shard(s) {','.join(map(str, missing))} wait for a producer")
        return "; ".join(parts)

    def no_progress(self) -> PipelineError | None:
        """Why the run cannot go on: every shard finished or stopped, and some stopped."""
        failed = [w for w in self.ledger.shards if w.failed]
        if failed and all(w.finished or w.failed for w in self.ledger.shards):
            return PipelineError(
                "no producer can make progress: "
                + "; ".join(f"shard {w.shard}: {w.failed}" for w in failed)
                + f". {ADVICE}"
            )
        return None

    # -- the control loop ---------------------------------------------------------------------------

    async def control_loop(self, router: zmq.asyncio.Socket) -> None:
        self._router = router
        conns = ControlConnections(router)
        try:
            while True:
                try:
                    wait = BYE_GRACE / 2 if self._closing else 1.0
                    got = await asyncio.wait_for(router.recv_multipart(copy=False), timeout=wait)
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

    def _tick(self) -> None:
        now = time.monotonic()
        if not self._settled and self._first_hello is not None and now - self._first_hello >= SETTLE_SECONDS:
            self._settle()
        for identity, (fd, at) in list(self._closing.items()):
            if now - at >= BYE_GRACE:
                del self._closing[identity]
                p = self.producers.get(identity)
                if p is not None and p.fd == fd:  # not back on a new connection meanwhile
                    self._leave(p, "connection closed", "closed")
        for p in list(self.producers.values()):
            if now - p.last_seen > HOLDER_SILENCE:
                self._leave(p, f"silent for {now - p.last_seen:.0f} s", "silent")
        if not self.stopping.is_set():  # frozen once the run is over: the last scrape shows who served it
            self.metrics.producers.set(self.connected(now))

    def _disconnected(self, fd: int) -> None:
        """A control connection closed: its producer is gone and its shards go to the others."""
        for p in list(self.producers.values()):
            if p.fd == fd:
                self._said_bye(p.identity)  # gone is as good as a `bye` to a stopping trainer
                self._closing[p.identity] = (fd, time.monotonic())  # its bye may be queued behind the close

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
        if self.stopping.is_set():
            if isinstance(msg, messages.Bye):
                self._count_skipped(msg.skipped)  # from a producer that has left too: its shards' counts
                self._said_bye(identity)
            elif isinstance(msg, messages.Hello) and self.stop_reason:  # the first stop is still on its way
                self._count_skipped(msg.skipped)  # or a stopping producer's last counts, before its bye
                self._send(identity, messages.Stop(self.stop_reason))
            return
        if isinstance(msg, messages.Hello):
            self._hello(identity, msg, fd)
        elif isinstance(msg, messages.Bye):  # a producer stopped (a signal, a scale-down): not lost
            if (p := self.producers.get(identity)) is None:
                self._reject("bad_control", "a bye from no producer of this session")
                return
            self._count_skipped(msg.skipped)
            self._closing.pop(identity, None)
            self._leave(p, "said goodbye", "bye")
        else:
            self._reject(
                "bad_control", f"a producer sent {type(msg).__name__.lower()}, only hello is expected"
            )

    # -- the handshake ------------------------------------------------------------------------------

    def _hello(self, identity: bytes, hello: messages.Hello, fd: int = -1) -> None:
        now = time.monotonic()
        where = printable(f"{hello.host}:{hello.pid}", 80)
        if hello.wire != WIRE_VERSION:  # its batches would all be rejected: say so now, not after the first
            return self._refuse(identity, where, version_skew(hello.wire), "wire_version")
        if identity in self._stopped:
            failed = [w for w in self.ledger.shards if w.failed]
            why = failed[0].failed if failed else "stopped"
            return self._refuse(identity, where, f"this producer was stopped: {why}", "worker_stopped")
        p = self.producers.get(identity)
        if p is not None:  # a heartbeat, or a known producer that lost and regained its connection
            p.last_seen, p.fd, p.waiting = now, fd, printable(hello.waiting, 200)
            self._count_skipped(hello.skipped)
            for s in p.shards:
                self.ledger[s].last_seen = now
            self._reconcile(p, hello)
            if self.credit_window and self._settled:  # a lost credit heals within a heartbeat
                self.grant(p.shards)
            return None
        twin = self._twin(where, hello)
        if twin is not None and hello.session == self.session:
            if not hello.rejoin:  # queued on a connection it has replaced since: nothing to answer
                log.debug("dropped a stale hello of %s from a replaced connection", twin.label())
                return
            return self._rekey(twin, identity, fd, now, hello)
        refusal = self.admission.admit(hello)
        if refusal is not None:
            return self._refuse(identity, where, *refusal)
        name = producer_name(hello.producer, self._joined, {q.name for q in self.producers.values()})
        p = Producer(identity, name, where, hello.producer, fd, now)
        p.waiting = printable(hello.waiting, 200)
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
            "%s joined from %s: holds shards %s%s (%d producers, %d shards)",
            p.name,
            where,
            shard_list(p.shards),
            taken_from(moved, p),
            len(self.producers),
            len(self.ledger),
        )

    def _twin(self, where: str, hello: messages.Hello) -> Producer | None:
        """The registered producer with the same host and pid as a hello from an unknown routing id. Only
        a hello naming this session (a secret of the trainer and its producers) may act on it.

        A producer keeps its routing id for life (shared/sockets.py), but when it reconnects while its old
        connection is still open on this side (a trainer paused past the heartbeat timeout), ROUTER_HANDOVER
        gives its id to the new connection and a random one to the old, whose queued hellos then arrive
        from a stranger: each would register a phantom holding shards until HOLDER_SILENCE."""
        if hello.pid <= 0 or not hello.host:
            return None
        return next((p for p in self.producers.values() if p.where == where), None)

    def _rekey(self, p: Producer, identity: bytes, fd: int, now: float, hello: messages.Hello) -> None:
        """A reconnected producer's rejoin replaces its registration at once: same name, shards and leases
        (its streams go on), under the routing id it speaks from now."""
        old = p.identity
        del self.producers[old]
        p.identity, p.fd, p.last_seen = identity, fd, now
        self.producers[identity] = p
        for s in p.shards:
            w = self.ledger[s]
            if w.identity == old:
                w.identity, w.last_seen = identity, now
        log.info("%s reconnected; it keeps shards %s", p.label(), shard_list(p.shards))
        self._count_skipped(hello.skipped)
        self._reconcile(p, hello)

    def _count_skipped(self, skipped: dict[str, int]) -> None:
        if self._skipped.update(skipped, len(self.ledger)):
            self.skipped = self._skipped.by_reason()  # replaced whole: the training thread reads it as is

    def _settle(self) -> None:
        """The session's first assignment, to every producer that has said hello so far."""
        self._settled = True
        self._rebalance()
        for p in self.producers.values():
            if not p.shards:
                self._send_assign(p)
            log.info(
                "%s joined from %s: holds shards %s (%d producers, %d shards)",
                p.name,
                p.where,
                shard_list(p.shards),
                len(self.producers),
                len(self.ledger),
            )

    def _reconcile(self, p: Producer, hello: messages.Hello) -> None:
        """Answer what the producer's hello shows it lacks: a lost or late assign or welcome heals here.
        Both are idempotent on the producer's side (a welcome it already follows, same lease, is ignored)."""
        if not self._settled:
            return
        if hello.session != self.session or hello.rejoin:  # it has not seen this session's answer yet
            self._send_assign(p)
            for s in sorted(p.shards):
                if not self.ledger[s].finished:
                    self._send_welcome(s)
            return
        held = set(hello.holding)
        if held - p.shards:
            self._send_assign(p)
        for s in sorted(p.shards - held):
            if self.ledger[s].open():
                self._send_welcome(s)

    # -- who holds what -----------------------------------------------------------------------------

    def _leave(self, p: Producer, why: str, reason: str) -> None:
        """`reason`: the label of lmpipe_trainer_producer_leaves_total (metrics.LEAVE_REASONS)."""
        if self.producers.pop(p.identity, None) is None:
            return
        self.metrics.producer_leaves.labels(reason).inc()
        if self.stopping.is_set():
            return  # the run is over: nothing to hand on
        if not self._settled:  # it held nothing yet
            log.info("%s (%s) left (%s) before shards were assigned", p.name, p.where, why)
            return
        for s in p.shards:
            w = self.ledger[s]
            if w.identity == p.identity:
                w.identity, w.where = None, ""
        moved = self._rebalance()
        to = moved_to(moved)
        log.info(
            "%s (%s) left (%s): shards %s %s (%d producers, %d shards)",
            p.name,
            p.where,
            why,
            shard_list({s for s in p.shards if self.ledger[s].open()}),
            f"moved {to}" if to else "wait for a producer" if not self.producers else "needed no move",
            len(self.producers),
            len(self.ledger),
        )

    def _rebalance(self) -> dict[int, tuple[Producer, str]]:
        """Re-divide the open shards over the producers (consumer/assign.py); tell every producer whose
        set changed, and welcome each shard at its new holder with a new lease. Returns, for the shards
        that changed hands, shard -> (new holder, old holder's name or "")."""
        open_shards = {w.shard for w in self.ledger.shards if w.open()}
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
            w = self.ledger[s]
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
            sum(1 for w in self.ledger.shards if w.identity is None and w.open())
        )

    def fail(self, shard: int, reason: str) -> None:
        """Stop a shard for good. Its producer is refused (it exits 2 with the reason) and never let back
        in this session; its other shards go to the other producers."""
        w = self.ledger[shard]
        if w.failed:
            return
        w.failed = reason
        self.metrics.shards_failed.set(sum(1 for x in self.ledger.shards if x.failed))
        log.error("stopped shard %d: %s. %s", shard, reason, ADVICE)
        p = self.producers.get(w.identity) if w.identity is not None else None
        if p is not None:
            self._stopped.add(p.identity)
            self._send(
                p.identity,
                messages.Refuse(f"the trainer stopped shard {shard}: {reason}. {ADVICE}"),
            )
            self._leave(p, f"stopped with shard {shard}", "stopped")

    # -- sending ------------------------------------------------------------------------------------

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

    def _send_welcome(self, shard: int, force: bool = False) -> None:
        w = self.ledger[shard]
        if w.identity is None:
            return
        with self.ledger.lock:
            welcome = messages.Welcome(
                self.session, shard, w.cursor.to_dict(), w.last_seq + 1, force, lease=w.lease,
                shards=len(self.ledger), first=self.ledger.first, space=self.ledger.space,
                credit=w.last_seq + self.credit_window if self.credit_window else None,
            )  # fmt: skip
        self._send(w.identity, welcome)

    def grant(self, shards: set[int]) -> None:
        """Send each holder of `shards` how far it may send them now (a mixture's credits), coalesced: one
        Credit per producer (split past messages.GRANTS_PER_MESSAGE)."""
        if not self.credit_window or self.stopping.is_set():
            return
        by_holder: dict[bytes, dict[int, int]] = {}
        with self.ledger.lock:
            for s in shards:
                w = self.ledger[s]
                if w.identity is not None and w.open():
                    by_holder.setdefault(w.identity, {})[s] = w.last_seq + self.credit_window
        for identity, grants in by_holder.items():
            for msg in messages.credits(self.session, grants):
                self._send(identity, msg)

    def _send_assign(self, p: Producer) -> None:
        self._send(
            p.identity,
            messages.Assign(self.session, sorted(p.shards), len(self.ledger), len(self.producers)),
        )

    def _refuse(self, identity: bytes, where: str, reason: str, code: str) -> None:
        self.metrics.refuse(code)  # a REFUSAL_REASONS code; also counted as a rejected message (handshake)
        # once a minute per peer: a misconfigured producer exits, but a buggy or hostile one may not
        self._quiet(logging.ERROR, f"refuse {where}", "refused producer at %s: %s", where, printable(reason))
        self._send(identity, messages.Refuse(reason))

    # -- the end of the run -------------------------------------------------------------------------

    def shutdown(self, reason: str) -> None:
        """Tell every producer to stop (when `reason` is given) and end the loops."""
        if self.stopping.is_set():
            return
        self.stop_reason = reason
        if reason and self._router is not None:
            for p in self.producers.values():
                if p.identity in self._closing:  # its connection closed already: no bye will come
                    continue
                self._send(p.identity, messages.Stop(reason))
                # Every open connection, not only producers heard from lately: behind a congested link
                # a live producer's hellos arrive late. A dead one's connection closes (heartbeats).
                self.awaiting_bye[p.identity] = p.label()
                log.debug("told %s to stop", p.label())
        if not self.awaiting_bye:
            self.all_said_bye.set()
        self.stopping.set()

    def _said_bye(self, identity: bytes) -> None:
        if self.awaiting_bye.pop(identity, None) and not self.awaiting_bye:
            self.all_said_bye.set()
