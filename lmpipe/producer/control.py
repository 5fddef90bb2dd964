"""The producer's control connection, served by a thread of its own.

The control DEALER socket and its monitor live in this thread only (a zmq socket is not thread-safe). The
thread says hello every HELLO_EVERY seconds (the heartbeat, naming the shards held, and what the producer
waits on) whatever the producer's main thread is doing: tokenizing one huge document, or sleeping between
storage retries. It hands everything it reads, the trainer's messages and the connection's events, to the
main thread through a queue, in the order read: the main thread handles them between batches, where the
holdings are not mid-update. A `stop` or `refuse` (and a trainer that keeps refusing the handshake, or a
launching process gone) also sets `stopping`, which the main thread checks between the tokenizer's calls
and waits on while it sleeps between storage retries, so it stops promptly.

A dropped connection is logged here when it happens; from then on the hellos say `rejoin` until the trainer
assigns or welcomes this producer again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from lmpipe.shared import messages
from lmpipe.shared.sockets import HandshakeFailed, HandshakeWatch
from lmpipe.shared.wire import WireError

log = logging.getLogger("lmpipe.producer")

TICK = 0.05  # seconds: the longest the thread sleeps between looks at its sockets and flags


def unresolved(endpoint: str) -> str:
    """'': a tcp:// endpoint whose host resolves (or an ipc:// one); else why not, for the waiting line.
    ZeroMQ retries an unresolvable name quietly forever; this says so (the name may appear later, as a
    Kubernetes Service's does, so the producer keeps waiting)."""
    if not endpoint.startswith("tcp://"):
        return ""
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        return f": the host name {host!r} does not resolve ({exc})"
    return ""


# what the thread hands over: ("msg", raw bytes), ("event", a monitor event), ("error", HandshakeFailed)
Item = tuple[str, Any]


class ControlChannel:
    def __init__(
        self,
        ctrl: zmq.Socket,
        monitor: zmq.Socket,
        watch: HandshakeWatch,
        *,
        hello: Callable[[], bytes],
        serving: Callable[[], bool],
        parent_gone: Callable[[], bool],
        stopping: threading.Event,
        every: float,
        waiting_for: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ctrl, self._monitor, self._watch = ctrl, monitor, watch
        self._hello, self._serving, self._parent_gone = hello, serving, parent_gone
        self.stopping = stopping
        self.every = every
        self._waiting_for = waiting_for  # the trainer's endpoint, for the "waiting for the trainer" line
        self._clock = clock
        # when the present wait for a trainer began, and what began it; None while a trainer serves us
        self._since: tuple[float, str] | None = (clock(), "this producer started")
        self._logged = 0.0  # when the waiting line was last logged (every 10 s; at once after a loss)
        self.inbox: queue.Queue[Item] = queue.Queue()
        self.dropped = False  # the connection dropped since the trainer last assigned or welcomed us
        self.parent_lost = False
        self._final: list[bytes] = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmpipe-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout: float) -> Item | None:
        """The next item read, waiting up to `timeout` seconds (0: only what is there)."""
        try:
            return self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def finish(self, final: list[bytes]) -> None:
        """Send `final` (the counts not yet told, the bye), close the sockets, end the thread."""
        self._final = final
        self._closing.set()
        self._thread.join()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._ctrl, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        last_hello = 0.0
        try:
            while not self._closing.is_set():
                now = self._clock()
                if self._parent_gone():
                    self.parent_lost = True
                    self.stopping.set()
                if now - last_hello >= self.every:
                    with contextlib.suppress(zmq.Again):  # no trainer connected yet
                        self._ctrl.send(self._hello(), zmq.NOBLOCK)
                    last_hello = now
                    self._watch.stalled(now)  # connected, never authenticated: say why instead of waiting
                    # (a welcome read but not yet handled by the main thread is no wait)
                    if not self._serving() and self._since is not None and now - self._logged > 10:
                        log.info("%s", self.waiting_line(now))
                        self._logged = now
                wait = max(0.0, min(TICK, last_hello + self.every - self._clock()))
                for sock, _ in poller.poll(timeout=int(1e3 * wait)):
                    if sock is self._monitor:
                        if self._event(parse_monitor_message(self._monitor.recv_multipart())):
                            last_hello = 0.0  # (re)connected: say hello now, not at the next tick
                    else:
                        self._message(self._ctrl.recv())
        except HandshakeFailed as exc:
            self.inbox.put(("error", exc))
            self.stopping.set()
        finally:
            with contextlib.suppress(zmq.Again):
                for raw in self._final:
                    self._ctrl.send(raw, zmq.NOBLOCK)
            self._ctrl.disable_monitor()
            self._monitor.close(0)
            self._ctrl.close(linger=1000)  # the bye just queued still goes out

    def waiting_line(self, now: float) -> str:
        """What a producer without a trainer logs every 10 s: how long it has waited, counted from when it
        lost its trainer (or from its start, before the first one welcomed it)."""
        since, what = self._since or (now, "a moment ago")
        return (
            f"waiting for the trainer at {self._waiting_for} ({now - since:.0f} s since {what})"
            + unresolved(self._waiting_for)
        )

    def _event(self, event: Mapping[str, Any]) -> bool:
        """One event of the connection's monitor; True when it is (back) up and a hello should go out."""
        up = self._watch(event)  # raises HandshakeFailed once the trainer keeps refusing this producer
        if event["event"] == zmq.EVENT_DISCONNECTED and self._serving() and not self.dropped:
            self.dropped = True
            self._since, self._logged = (self._clock(), "the connection dropped"), 0.0
            log.info("lost the connection to the trainer; holding batches until it welcomes this producer")
        self.inbox.put(("event", event))
        return up

    def _message(self, raw: bytes) -> None:
        try:
            msg: object = messages.unpack(raw)
        except WireError:
            msg = None  # the main thread's handling says so
        if isinstance(msg, (messages.Assign, messages.Welcome)):
            self.dropped, self._since = False, None
        self.inbox.put(("msg", raw))
        if isinstance(msg, (messages.Stop, messages.Refuse)):
            self.stopping.set()  # after the put: whoever sees the flag finds the message queued
