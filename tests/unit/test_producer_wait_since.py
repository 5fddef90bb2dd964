"""A producer that lost its trainer says how long it has waited since it lost it, not since it started, and
its `connected` gauge reads 0 meanwhile."""

from __future__ import annotations

import threading

import zmq

from lmpipe.producer import manager
from lmpipe.producer.control import ControlChannel
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import HandshakeWatch, endpoints

DROP = {"event": zmq.EVENT_DISCONNECTED, "value": 0, "endpoint": b""}


def test_the_wait_is_counted_from_the_start_then_from_the_lost_connection(tmp_path):
    ep = endpoints(PipelineConfig(runtime_dir=str(tmp_path / "r")))
    ctx = zmq.Context()
    ctrl = ctx.socket(zmq.DEALER)
    monitor = ctrl.get_monitor_socket()
    clock = [1000.0]
    serving = [False]
    try:
        ch = ControlChannel(ctrl, monitor, HandshakeWatch(ep), hello=lambda: b"", serving=lambda: serving[0],
                            parent_gone=lambda: False, stopping=threading.Event(), every=1.0,
                            waiting_for="tcp://trainer:5555", clock=lambda: clock[0])  # fmt: skip
        clock[0] = 1030.0
        assert ch.waiting_line(clock[0]).startswith(
            "waiting for the trainer at tcp://trainer:5555 (30 s since this producer started)"
        )
        ch._message(messages.pack(messages.Assign(session="s", shards=[0], total=1)))  # welcomed
        serving[0] = True
        clock[0] = 1500.0  # 470 s of serving, then the trainer is lost
        ch._event(DROP)
        serving[0] = False
        clock[0] = 1512.0
        assert "(12 s since the connection dropped)" in ch.waiting_line(clock[0])
        clock[0] = 1600.0  # still waiting: counted from the drop
        assert "(100 s since the connection dropped)" in ch.waiting_line(clock[0])
    finally:
        monitor.close(0)
        ctrl.close(0)
        ctx.term()


def test_connected_reads_0_while_the_trainer_is_lost(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a b c\n\nd e f\n")
    p = manager.Producer(
        PipelineConfig(data=[str(corpus)], runtime_dir=str(tmp_path / "r")), manager.ProducerOptions(worker=0)
    )

    def connected() -> float | None:
        return p.metrics.registry.get_sample_value("lmpipe_producer_connected", {"producer": "0"})

    assert connected() == 0, "no trainer yet"
    p._control(messages.pack(messages.Assign(session="s", shards=[0], total=1)))
    assert connected() == 1
    p._connection(DROP)
    assert connected() == 0, "the trainer is lost: it holds its batches and waits"
    p._control(messages.pack(messages.Assign(session="s", shards=[0], total=1)))  # welcomed back
    assert connected() == 1
