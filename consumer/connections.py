"""Which control connection a producer's hello came on, and when that connection closes.

A worker id may change hands only once its holder is known to be gone. The trainer's ROUTER cannot say so
itself (ROUTER_NOTIFY is a draft API that pyzmq's bundled libzmq leaves out), so this reads two things
libzmq does report:
- each received message's source file descriptor (ZMQ_SRCFD; deprecated in libzmq but present in 4.x),
  remembered for the holder of a worker id when its hello arrives;
- the socket monitor's EVENT_DISCONNECTED, whose value is the file descriptor of the connection that
  closed: a process that exited or was killed, a peer cut off for an oversized message, or one whose
  ZMTP heartbeats stopped for 30 s (a frozen process, an unreachable host).

Order makes this safe against file descriptor reuse: libzmq emits DISCONNECTED before it closes the
descriptor, so the event is queued before any later connection can get the same number, and the receiver
drains the monitor before it handles each control message.
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
