"""What checking remote objects for rewrites costs a pass (producer/formats.py: check_objects).

    python -m bench.object_checks [--objects 100] [--latency-ms 20]

A local HTTP server serves --objects small text objects, each request answered after --latency-ms (a
store's round trip; loopback alone has none), with a Content-MD5 (the objects' version). One producer
worker's pass over them (records(), no tokenizer) is timed three ways, side by side, best of --rounds:
with no check, with one HEAD request an object at the pass's start and end one after another (what a
check per object costs), and with the shipped check, all objects' HEADs at once (16 in flight).
Writes bench/results/object-checks-<date>.md.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import threading
import time
from collections.abc import Callable

from bench.common import table, write_result
from lmpipe.producer import formats
from lmpipe.producer.sources import Corpus

BODY = b"".join(b"document %d of the corpus\n\n" % i for i in range(20))


def serve(latency: float) -> http.server.ThreadingHTTPServer:
    md5 = base64.b64encode(hashlib.md5(BODY).digest()).decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a store's client keeps its connections

        def log_message(self, *args) -> None:
            pass

        def _send(self, head: bool) -> None:
            time.sleep(latency)
            data, headers = BODY, {}
            if rng := self.headers.get("Range"):
                a, _, b = rng.split("=")[1].partition("-")
                data = BODY[int(a) : (int(b) + 1 if b else len(BODY))]
                headers["Content-Range"] = f"bytes {a}-{int(a) + len(data) - 1}/{len(BODY)}"
            self.send_response(206 if headers else 200)
            headers |= {"Content-MD5": md5, "Content-Length": str(len(data)), "Accept-Ranges": "bytes"}
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            self._send(True)

        def do_GET(self) -> None:
            self._send(False)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def one_by_one(files: list[formats.DataFile], in_flight: int = 16) -> None:
    for f in files:
        if f.remote is not None and f.version is not None:
            formats._check_object(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=100)
    p.add_argument("--latency-ms", type=float, default=20.0, help="the server's delay before each answer")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="results directory (default: bench/results)")
    args = p.parse_args()
    server = serve(args.latency_ms / 1e3)
    port = server.server_address[1]
    corpus = Corpus([f"http://127.0.0.1:{port}/c{i:05d}.txt" for i in range(args.objects)])
    assert all(f.version for f in corpus.paths), "the server's Content-MD5 is the objects' version"
    shipped = formats.check_objects
    ways: dict[str, Callable] = {
        "no check": lambda files, in_flight=16: None,
        "a HEAD an object at the pass's start and end, one after another": one_by_one,
        "all objects' HEADs at once at the start and end (shipped)": shipped,
    }
    best = dict.fromkeys(ways, float("inf"))
    try:
        for _ in range(args.rounds):  # ways take turns, so a busy machine slows them alike
            for name, check in ways.items():
                formats.check_objects = check
                t0 = time.perf_counter()
                n = sum(1 for _ in corpus.records())
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        formats.check_objects = shipped
        server.shutdown()
    base = best["no check"]
    rows = [[name, s, s / base] for name, s in best.items()]
    body = (
        f"{args.objects} objects of {len(BODY)} bytes ({n} records a pass) over HTTP on loopback, "
        f"{args.latency_ms:g} ms before each answer; best of {args.rounds} passes each.\n\n"
        + table(["check", "seconds a pass", "vs no check"], rows)
    )
    print(body)
    write_result("object-checks", "What checking remote objects for rewrites costs a pass", body, args.out)


if __name__ == "__main__":
    main()
