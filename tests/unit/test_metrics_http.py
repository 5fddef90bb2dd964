"""The bounded /metrics server (shared/metrics_http.py): it answers, caps open connections, cuts off slow
clients, and says when its port is taken."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from lmpipe.shared import metrics_http
from lmpipe.shared.metrics import TrainerMetrics, serve
from lmpipe.shared.metrics_http import MAX_CONNECTIONS, MetricsServer, PortInUse


def _closed(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_it_serves_the_registry():
    m = TrainerMetrics()
    port = serve(m.registry, 0)
    assert port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "lmpipe_trainer_global_step 0.0" in text
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)


def test_excess_connections_are_closed_and_slow_ones_cut_off(monkeypatch):
    monkeypatch.setattr(metrics_http, "REQUEST_SECONDS", 1.0)
    server = MetricsServer(lambda: b"x 1\n", "text/plain", 0)
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
        for s in held:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
        deadline = time.monotonic() + 5
        while server.open < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert _closed(extra, 2), "a connection past the cap was kept"
        assert server.refused >= 1
        assert all(_closed(s, 3) for s in held), "a half-open request outlived its deadline"
        # and it answers again once they are gone
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read()
        assert body == b"x 1\n"
        for s in [*held, extra]:
            s.close()
    finally:
        server.close()


def test_a_taken_port_is_said():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(PortInUse, match="already in use"):
            MetricsServer(lambda: b"", "text/plain", s.getsockname()[1])


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    import subprocess
    import sys

    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048));"
        "from lmpipe.shared.metrics_http import raise_open_files_limit; raise_open_files_limit();"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(2048, 2048)"
