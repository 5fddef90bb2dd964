"""`lmpipe health`, the containers' health check: a trainer is healthy while it steps, not merely while
its /metrics answers; real trainer and producer processes."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.deploy.scrape import scrape, wait_for_scrape
from tests.helpers import free_port_pair, free_ports, lmpipe_env


def health(port: int, *args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "lmpipe", "health", "--metrics-port", str(port), *args],
                       env=lmpipe_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.stdout.count("\n") == 1 and not r.stderr, (r.stdout, r.stderr)
    return r.returncode, r.stdout.strip()


def test_a_trainer_is_healthy_while_it_steps(procs):
    port, mport = free_port_pair(), free_ports(2)
    common = ["--port", str(port), "--producers", "1", "--builtin-docs", "200", "--seq-len", "64",
              "--batch-size", "4", "--epochs", "0"]  # fmt: skip
    trainer = procs.start("train", *common, "--steps", "0", "--metrics-port", str(mport), name="trainer")
    procs.wait_for(trainer, "listening on", timeout=60)
    wait_for_scrape(mport)
    time.sleep(1.5)
    # no producer yet: no step since its start
    rc, line = health(mport, "--stalled-after", "1")
    assert rc == 1 and line.startswith("unhealthy: trainer at step 0,") and "since its start" in line, line
    rc, line = health(mport)
    assert rc == 0 and line.startswith("healthy: trainer at step 0,"), line

    procs.start("produce", *common, "--worker", "0", "--metrics-port", str(mport + 1), name="producer")
    deadline = time.monotonic() + 60
    while scrape(mport).get("lmpipe_trainer_global_step") < 3:
        assert time.monotonic() < deadline, procs.log(trainer)[-2000:]
        time.sleep(0.2)
    rc, line = health(mport, "--stalled-after", "30")
    assert rc == 0 and "since its latest step" in line, line
    rc, line = health(mport + 1)
    assert rc == 0 and line == f"healthy: lmpipe producer answers at http://127.0.0.1:{mport + 1}/metrics"

    trainer.send_signal(19)  # SIGSTOP: a hung trainer; its /metrics thread stops with it
    try:
        rc, line = health(mport)
        assert rc == 1 and line.startswith("unhealthy: ") and "does not answer" in line, line
    finally:
        trainer.send_signal(18)  # SIGCONT, for the cleanup


def test_nothing_listening_is_unhealthy():
    rc, line = health(free_ports(1))
    assert rc == 1 and "does not answer" in line, line


def test_another_server_on_the_port_is_unhealthy():
    """A trainer whose metrics port was taken logs that it exports none and trains on; `health` must not
    then vouch for whatever holds the port."""
    import http.server
    import threading

    bodies = iter(
        [b"", b"# HELP other_total x\n# TYPE other_total counter\nother_total 1\n", b"\xff\xfe\x00"]
    )

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(bodies)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for says in ("no lmpipe_build_info", "no lmpipe_build_info", "not with Prometheus metrics"):
            rc, line = health(srv.server_address[1])
            assert rc == 1 and says in line, line
    finally:
        srv.shutdown()
