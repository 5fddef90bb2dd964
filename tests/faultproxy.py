"""A small fault-injecting HTTP proxy on loopback, in front of a test's S3 server (tests/s3server.py).

Each request is forwarded whole to the upstream, unless a fault applies: `delay` seconds before each
forward, every `fail_every`-th request answered with `fail_status` (503 SlowDown or 429) in S3's error
XML, or, while `down`, the connection closed with no answer (a stopped server). While `reads_down` names
a path (/bucket/key), only reads of that object's bytes (GETs with a Range header) are closed so: an
outage that a producer meets where its reading reaches that object, after its start-up checks (which read
the first object only), its listings and HEADs. `requests` and `failed` count what it saw.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CODES = {503: "SlowDown", 429: "TooManyRequests"}


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.delay = 0.0
        self.fail_every = 0
        self.fail_status = 503
        self.down = False
        self.reads_down = ""
        self.requests = 0
        self.failed = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.fail_every and proxy.requests % proxy.fail_every == 0
                    proxy.failed += bool(fail)
                read = self.command == "GET" and "Range" in self.headers
                if proxy.down or (read and proxy.reads_down and self.path.split("?")[0] == proxy.reads_down):
                    self.close_connection = True
                    self.connection.close()
                    return
                if proxy.delay:
                    time.sleep(proxy.delay)
                if fail:
                    code = _CODES.get(proxy.fail_status, "ServiceUnavailable")
                    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                    xml += "<Message>Please reduce your request rate.</Message></Error>"
                    self._answer(proxy.fail_status, [("Content-Type", "application/xml")], xml.encode())
                    return
                up = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                up.request(self.command, self.path, body=body or None, headers=headers)
                r = up.getresponse()
                data = r.read()
                keep = [
                    (k, v)
                    for k, v in r.getheaders()
                    if k.lower() not in ("connection", "transfer-encoding", "content-length")
                    or (k.lower() == "content-length" and self.command == "HEAD")
                ]
                up.close()
                self._answer(r.status, keep, data)

            def _answer(self, status: int, headers: list, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if self.command != "HEAD" or not any(k.lower() == "content-length" for k, _ in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
