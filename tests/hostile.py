"""A hostile local client for tests/e2e/test_hostile.py: the attacks of issue 10, with real pyzmq sockets.

tests/e2e/test_hostile.py runs `serve` in a child process, as another user for the default deployment (or
`python tests/hostile.py TARGETS_JSON` by hand). It reads one JSON command per line and answers each with
one JSON line of figures, so that the test can interleave attacks with its own measurements. It knows everything a local attacker could: the port, the runtime
directory of the trainer's user, the trainer's public CURVE key and the full pipeline configuration; it
lacks only what authentication is about (the user's rights, an authorized key).

TARGETS_JSON: {"data": [endpoint, ...], "control": [endpoint, ...], "server_key": z85 or null,
               "metrics": url, "vocab_size": int, "producers": int, "batch_size": int, "seq_len": int}
With a server key, every attack is made twice per endpoint: without keys and with a key pair of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import time
import urllib.request
from typing import Any, TextIO

import numpy as np
import numpy.random  # noqa: F401 - loaded now: a forked child running as `nobody` may not read the stdlib
import zmq

from lmpipe.shared import messages
from lmpipe.shared.batch import Batch, Cursor, end_frames
from lmpipe.shared.wire import WIRE_VERSION


class Hostile:
    def __init__(self, targets: dict[str, Any]):
        self.t = targets
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.MAX_SOCKETS, 4096)
        self.own_keys = zmq.curve_keypair()
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        self.session = ""  # whatever /metrics gives away

    def sockets(self, kind: int, endpoints: list[str]) -> list[zmq.Socket]:
        out = []
        server_key = self.t.get("server_key")
        for ep in endpoints:
            for keyed in (False, True) if server_key and ep.startswith("tcp") else (False,):
                s = self.ctx.socket(kind)
                s.linger = 0
                s.sndhwm = 1000
                if keyed:
                    s.curve_publickey, s.curve_secretkey = self.own_keys
                    s.curve_serverkey = server_key.encode()
                s.connect(ep)
                out.append(s)
        return out

    def close(self, socks: list[zmq.Socket], after: float) -> None:
        time.sleep(after)  # let the connection attempts happen before the queued messages are dropped
        for s in socks:
            s.close(0)

    # -- attacks -------------------------------------------------------------------------------------

    def scrape(self) -> dict:
        try:
            with urllib.request.urlopen(self.t["metrics"], timeout=5) as r:
                text = r.read().decode()
        except OSError as exc:
            return {"reachable": False, "error": str(exc)}
        info = [ln for ln in text.splitlines() if ln.startswith("lmpipe_trainer_info")]
        if 'session="' in text:
            self.session = text.split('session="', 1)[1].split('"', 1)[0]
        return {"reachable": True, "info": info, "session_found": bool(self.session)}

    def _forged_batch(self, worker: int, seq: int) -> list:
        b, t, vocab = self.t["batch_size"], self.t["seq_len"], self.t["vocab_size"]
        batch = Batch(
            tokens=self.rng.integers(0, vocab, (b, t)).astype("<u2"),
            lengths=np.full(b, t, "<i4"),
            seg=np.zeros((b, t), "<u2"),
            doc_id=np.arange(10_000_000 + seq * b, 10_000_000 + (seq + 1) * b, dtype="<i8"),  # fake ids
            doc_start=np.zeros(b, "<i4"),
            doc_len=np.full(b, t, "<i4"),
            strategy="pack",
            cursor=Cursor(0, 10 * seq),
        )
        return batch.to_frames(self.session or os.urandom(6).hex(), worker, seq)

    def forge(self, n: int) -> dict:
        socks = self.sockets(zmq.PUSH, self.t["data"])
        sent = 0
        for i in range(n):
            for s in socks:
                try:
                    s.send_multipart(self._forged_batch(i % self.t["producers"], 2 + i // 2), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        self.close(socks, 1.5)
        return {"batches_sent": sent, "sockets": len(socks)}

    def end(self, n: int) -> dict:
        socks = self.sockets(zmq.PUSH, self.t["data"])
        sent = 0
        for i in range(n):
            for s in socks:
                frames = end_frames(self.session or "x", i % self.t["producers"], 1 + i, Cursor(1))
                try:
                    s.send_multipart(frames, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        self.close(socks, 1.5)
        return {"ends_sent": sent}

    def resets(self, n: int) -> dict:
        """Out-of-order sequence numbers in this session (if /metrics gave it away): a gap used to make
        the trainer send the producer back to its cursor."""
        socks = self.sockets(zmq.PUSH, self.t["data"])
        sent = 0
        for i in range(n):
            for s in socks:
                try:
                    s.send_multipart(self._forged_batch(i % self.t["producers"], 10_000 + 7 * i), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        self.close(socks, 1.5)
        return {"out_of_order_sent": sent}

    def hello(self, worker: int, fingerprint: dict, seconds: float) -> dict:
        """Claim a worker id with the pipeline's real fingerprint; collect every answer."""
        socks = self.sockets(zmq.DEALER, self.t["control"])
        hello = messages.pack(
            messages.Hello(
                producer=worker,
                fingerprint=fingerprint,
                pid=os.getpid(),
                host="attacker",
                session=self.session,
                wire=WIRE_VERSION,
            )  # fmt: skip
        )
        answers: list[str] = []
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        next_hello = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_hello:
                for s in socks:
                    with contextlib.suppress(zmq.Again):
                        s.send(hello, zmq.NOBLOCK)
                next_hello = time.monotonic() + 0.5
            for s, _ in poller.poll(100):
                msg = messages.unpack(s.recv())
                answers.append(f"{type(msg).__name__}: {getattr(msg, 'reason', '')}")
        self.close(socks, 0)
        welcomed = any(a.startswith("Welcome") for a in answers)
        return {"answers": answers[:5], "n_answers": len(answers), "welcomed": welcomed}

    def flood(self, conns: int, seconds: float, frame_bytes: int) -> dict:
        """Half the connections are ZeroMQ sockets pushing junk frames, half raw stream sockets writing
        junk as fast as the trainer reads it, reconnecting whenever they are cut."""
        junk = os.urandom(frame_bytes)
        zsocks = []
        for i in range(conns // 2):
            ep = self.t["data"][i % len(self.t["data"])]
            s = self.ctx.socket(zmq.PUSH)
            s.linger, s.sndhwm = 0, 2
            if self.t.get("server_key") and ep.startswith("tcp") and i % 2:
                s.curve_publickey, s.curve_secretkey = self.own_keys
                s.curve_serverkey = self.t["server_key"].encode()
            s.connect(ep)
            for _ in range(2):
                try:
                    s.send(junk, zmq.NOBLOCK)
                except zmq.Again:
                    break
            zsocks.append(s)
        raw: list[tuple[socket.socket | None, str, int]] = [(None, "", 0)] * (conns - conns // 2)
        attempts = failed = written = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for i, (sock, ep, off) in enumerate(raw):
                if sock is None:
                    ep = random.choice(self.t["data"])
                    unix = ep.startswith("ipc://")
                    sock = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
                    sock.setblocking(False)
                    host, _, port = ep[6:].rpartition(":")
                    attempts += 1
                    try:
                        sock.connect(ep[6:] if unix else (host, int(port)))
                    except BlockingIOError:
                        pass  # connecting; the first send tells
                    except OSError:  # refused: no such listener, or no permission (another user's socket)
                        failed += 1
                        sock.close()
                        continue
                    off = 0
                try:
                    n = sock.send(junk[off : off + 65536])
                    written += n
                    raw[i] = (sock, ep, (off + n) % len(junk))
                except BlockingIOError:
                    raw[i] = (sock, ep, off)
                except OSError:  # cut off by the trainer (or the connect failed): reconnect
                    failed += off == 0
                    sock.close()
                    raw[i] = (None, "", 0)
            time.sleep(0.001)
        for sock, _, _ in raw:
            if sock is not None:
                sock.close()
        for s in zsocks:
            s.close(0)
        return {"zmq_sockets": len(zsocks), "raw_connects": attempts, "raw_refused": failed,
                "raw_bytes_written": written}  # fmt: skip


def serve(targets: dict[str, Any], commands: TextIO, out: TextIO) -> None:
    h = Hostile(targets)
    print(json.dumps({"ready": True, "uid": os.getuid()}), file=out, flush=True)
    for line in commands:
        cmd = json.loads(line)
        op = cmd.pop("op")
        print(json.dumps(getattr(h, op)(**cmd)), file=out, flush=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]), sys.stdin, sys.stdout)
