"""Issue 35 item 5: `lmpipe health` against pages that are not a healthy trainer's, and against a port
another user holds. Each is one line and exit 1 (unhealthy), never a traceback or a usage error (2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.helpers import REPO, lmpipe_env

NOBODY = 65534


def _page(step: str = "12.0", timestamp: bool = True) -> bytes:
    lines = [
        'lmpipe_build_info{python="3",role="trainer",version="0"} 1.0',
        f"lmpipe_trainer_global_step {step}",
        f"process_start_time_seconds {time.time() - 5}",
    ]
    if timestamp:
        lines.append(f"lmpipe_trainer_last_step_timestamp_seconds {time.time()}")
    return ("\n".join(lines) + "\n").encode()


def _server(body: bytes) -> HTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _health(port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmpipe", "health", "--metrics-port", str(port)], cwd=REPO,
                          env=lmpipe_env(), capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("page", "expect"),
    [
        ({}, "healthy: trainer at step 12"),
        ({"timestamp": False}, "without lmpipe_trainer_last_step_timestamp_seconds"),
        ({"step": "NaN"}, "reports step nan"),
    ],
    ids=["healthy", "no-timestamp", "nan-step"],
)
def test_health_says_one_line_on_every_page(page, expect):
    server = _server(_page(**page))  # made now: its last step's time is the test's, not collection's
    try:
        out = _health(server.server_port)
    finally:
        server.shutdown()
    assert expect in out.stdout, out.stdout + out.stderr
    assert out.returncode == (0 if expect.startswith("healthy") else 1), out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stdout.splitlines()) == 1, out.stdout + out.stderr


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="needs root on Linux to serve as another user (nobody)",
)
def test_a_port_squatted_by_another_user_is_unhealthy():
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the squatter, as nobody, serving figures that look healthy
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            server = _server(_page())
            os.write(w, str(server.server_port).encode())
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(w)
    try:
        port = int(os.read(r, 16))
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        out = _health(port)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"port {port} is served by another user (uid {NOBODY})" in out.stdout, out.stdout
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(r)
