"""Which connections the trainer's sockets have, and which of them belong to authenticated producers.

Control (ROUTER): a shard may change hands only once its holder is known to be gone. The trainer's ROUTER cannot say so
itself (ROUTER_NOTIFY is a draft API that pyzmq's bundled libzmq leaves out), so this reads two things
libzmq does report:
- each received message's source file descriptor (ZMQ_SRCFD; deprecated in libzmq but present in 4.x),
  remembered for a producer when its hello arrives;
- the socket monitor's EVENT_DISCONNECTED, whose value is the file descriptor of the connection that
  closed: a process that exited or was killed, a peer cut off for an oversized message, or one whose
  ZMTP heartbeats stopped for 30 s (a frozen process, an unreachable host).

Order makes this safe against file descriptor reuse: libzmq emits DISCONNECTED before it closes the
descriptor, so the event is queued before any later connection can get the same number, and the receiver
drains the monitor before it handles each control message.

Data (PULL): only a peer that completed the ZMTP handshake (CURVE included) is a producer; a port scanner,
a plain socket at a CURVE trainer or a client with another key must not count as a producer's disconnect
(`DataPeers`).
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message


class ControlConnections:
    def __init__(self, router: Any):
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._router = router

    @staticmethod
    def fd(frame: zmq.Frame) -> int:
        """The file descriptor of the connection a received frame came on."""
        return int(frame.get(zmq.SRCFD))

    def closed(self) -> list[int]:
        """File descriptors of the connections that closed since the last call (never blocks)."""
        out: list[int] = []
        while True:
            try:
                raw = self.monitor.recv_multipart(zmq.NOBLOCK)
                if not isinstance(raw, list):  # an asyncio socket hands back a finished Future
                    raw = raw.result()
            except zmq.Again:
                return out
            event = parse_monitor_message(raw)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                out.append(int(event["value"]))

    def close(self) -> None:
        # The control task runs this in its `finally`; the receiver closes the router after a bounded wait
        # for the tasks, so a late task may find it closed already (a ZMQError that surfaced as "Task
        # exception was never retrieved" at about one shutdown in four on a busy machine).
        if not self._router.closed:
            self._router.disable_monitor()
        self.monitor.close(0)


HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
DATA_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED


class DataPeers:
    """Which data connections are authenticated, from the data socket's monitor (DATA_EVENTS).

    ACCEPTED and DISCONNECTED carry the connection's file descriptor; HANDSHAKE_SUCCEEDED carries none (its
    value is 0 in libzmq 4.3, and the monitor's v2 format that names the peer is a draft API). So a success
    is given to the connection when only one handshake is pending, and otherwise left unclaimed until one
    of the pending connections delivers a message (ZMQ_SRCFD) or all pending ones are accounted for. A
    failed handshake is followed at once by its connection's DISCONNECTED (libzmq emits both from the
    same error path); a peer that sent no valid greeting gets no handshake event at all."""

    def __init__(self) -> None:
        self.pending: set[int] = set()  # accepted, handshake not known to have succeeded
        self.authed: set[int] = set()
        self.unclaimed = 0  # successes not yet given to a pending connection
        self._failed = False  # the last event was a failed handshake

    def delivered(self, fd: int) -> None:
        """A message arrived on `fd`: its peer is authenticated."""
        if fd in self.pending:
            self.pending.discard(fd)
            self.unclaimed = max(0, self.unclaimed - 1)
        self.authed.add(fd)

    def event(self, event: int, fd: int) -> bool:
        """Take one monitor event (`fd`: its value); True for the disconnect of an authenticated peer."""
        failed, self._failed = self._failed, bool(event & HANDSHAKE_FAILED)
        if event == zmq.EVENT_ACCEPTED:
            if fd not in self.authed:  # else it delivered a message before its ACCEPTED was read
                self.pending.add(fd)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.unclaimed += 1
            if len(self.pending) == 1:
                self.delivered(next(iter(self.pending)))
        elif event == zmq.EVENT_DISCONNECTED:
            if fd in self.authed:
                self.authed.discard(fd)
                return True
            if fd not in self.pending:
                return False
            all_succeeded = not failed and 0 < len(self.pending) <= self.unclaimed
            self.pending.discard(fd)
            if all_succeeded:
                self.unclaimed -= 1
                return True
        self.unclaimed = min(self.unclaimed, len(self.pending))
        return False
