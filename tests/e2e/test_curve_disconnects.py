"""A CURVE trainer counts only authenticated producers' data connections as disconnects (issue 35):
plain ZeroMQ sockets and raw TCP clients at its data port leave the counter and the log quiet, while an
authenticated producer's connection still counts when it goes."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import zmq
from prometheus_client.parser import text_string_to_metric_families

from lmpipe.shared.security import generate_keys
from tests.helpers import free_ports, wait_until

DISCONNECTS = "lmpipe_trainer_data_disconnects_total"
CLOSED_LINE = "a producer's data connection closed"


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def strangers(port: int) -> None:
    """A plain (NULL mechanism) ZeroMQ socket, a raw TCP client that closes, one that sends garbage."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send(b"not a batch", zmq.NOBLOCK) if push.poll(500, zmq.POLLOUT) else None
    time.sleep(0.5)
    push.close()
    ctx.term()
    with socket.create_connection(("127.0.0.1", port)):
        time.sleep(0.3)
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"GET /metrics HTTP/1.0\r\n\r\n" * 4)
        time.sleep(0.3)


def test_unauthenticated_peers_are_not_producer_disconnects(procs, tmp_path):
    keys = generate_keys(tmp_path / "keys")
    port = free_ports(3)  # data, control, metrics
    common = ["--producers", "1", "--builtin-docs", "50000", "--epochs", "0", "--port", str(port)]
    train = procs.start(
        "train", *common, "--curve-dir", str(keys), "--metrics-port", str(port + 2), name="trainer"
    )
    procs.wait_for(train, "listening on")
    strangers(port)
    producer = procs.start("produce", *common, "--curve-dir", str(keys), "--metrics-port", "-1", name="good")
    wait_until(lambda: "joined from" in procs.log(train), 90, "the producer joined")
    assert metric(port + 2, DISCONNECTS) == 0
    assert CLOSED_LINE not in procs.log(train)
    os.kill(producer.pid, signal.SIGKILL)  # an authenticated producer gone: counted, and said
    wait_until(lambda: metric(port + 2, DISCONNECTS) >= 1, 60, "the producer's disconnect counted")
    time.sleep(1)
    assert metric(port + 2, DISCONNECTS) == 1
    assert procs.log(train).count(CLOSED_LINE) == 1
