"""The /metrics HTTP endpoint: one thread, one event loop, a bounded number of connections, each with a
deadline; prometheus_client's `generate_latest` writes the page.

Why not prometheus_client's own `start_http_server`: it runs a thread per connection with no timeout, so
each half-open request from any local user held a thread and a file descriptor until the process ran out
of descriptors and its next checkpoint failed (1,100 connections under the usual limit of 1024). No
maintained library offers the three things needed here (aiohttp and the stdlib's servers have no cap on
concurrent connections), and a server that answers one GET is small, so it is written here on asyncio.

A client gets REQUEST_SECONDS for its whole exchange (request read and answer written) and is then cut off;
past MAX_CONNECTIONS open at once, a new connection is closed as soon as it is accepted. So the endpoint
holds at most MAX_CONNECTIONS + 1 descriptors whatever reaches it; a flood can keep a scraper out, never
the process from its own work.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32  # Prometheus scrapes with one connection; a few people's curl beside it
REQUEST_SECONDS = 5.0
MAX_REQUEST_BYTES = 8192  # a GET's request line and headers
OPEN_FILES_WANTED = 65536  # where the hard limit is unlimited


class PortInUse(OSError):
    """The metrics port is held by another process (of this user or another)."""


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files to the hard limit (at most OPEN_FILES_WANTED where
    that is unlimited): the default soft limit, often 1024, is what a flood or many producers exhaust."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # a container may forbid it: the default stays
        log.debug("open files limit unchanged (%s)", exc)


def _answer(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class MetricsServer:
    """Serves `page()` at /metrics (and /) on a listening socket bound now, from a daemon thread."""

    def __init__(self, page: Callable[[], bytes], content_type: str, port: int, addr: str = "127.0.0.1"):
        self.page, self.content_type = page, content_type
        family, kind, proto, _, where = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.sock = socket.socket(family, kind, proto)
        try:
            # no SO_REUSEADDR beyond the usual TIME_WAIT reuse; never SO_REUSEPORT, which would let
            # another process of this user share the port
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(where)
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(exc.errno, f"{addr}:{port} is already in use by another process") from None
            raise
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.open = 0  # connections being served now
        self.refused = 0  # connections closed at once, past MAX_CONNECTIONS
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._quiet)
        self._thread = threading.Thread(target=self._serve, name="lmpipe-metrics", daemon=True)
        self._thread.start()

    @staticmethod
    def _quiet(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        # accept() out of descriptors (EMFILE) and peers that vanish: asyncio retries; nothing to report
        log.debug("metrics server: %s", context.get("message"))

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(self._accept_forever())

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)

    async def _accept_forever(self) -> None:
        """Accept one connection at a time and decide on it at once (asyncio's own server accepts a
        backlog's worth before any handler runs: 400 descriptors at a time under a flood)."""
        tasks: set[asyncio.Task] = set()
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self.sock)
            except OSError as exc:  # EMFILE and the like: the process needs its descriptors more
                log.debug("metrics server: accept failed (%s)", exc)
                await asyncio.sleep(0.1)
                continue
            if self.open >= MAX_CONNECTIONS:
                self.refused += 1
                conn.close()  # at once: no buffer, no timer kept for it
                continue
            self.open += 1
            task = self._loop.create_task(self._handle(conn))
            tasks.add(task)  # a reference until it ends (the loop keeps only weak ones)
            task.add_done_callback(tasks.discard)

    async def _handle(self, conn: socket.socket) -> None:
        writer = None
        try:
            async with asyncio.timeout(REQUEST_SECONDS):
                reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_REQUEST_BYTES)
                await self._exchange(reader, writer)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # a slow, silent, broken or oversized client: cut off
        finally:
            self.open -= 1
            if writer is not None:
                writer.transport.abort()
            else:
                conn.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method not in (b"GET", b"HEAD"):
            answer = _answer("405 Method Not Allowed", b"GET /metrics\n")
        elif path in (b"/metrics", b"/"):
            body = self.page()
            answer = _answer("200 OK", b"" if method == b"HEAD" else body, self.content_type)
        else:
            answer = _answer("404 Not Found", b"GET /metrics\n")
        writer.write(answer)
        await writer.drain()
