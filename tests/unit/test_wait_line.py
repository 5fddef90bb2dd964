"""The trainer's wait line says what connected producers wait on (storage retries) instead of blaming
producers that are not there."""

from __future__ import annotations

import time

from lmpipe.shared import messages
from lmpipe.shared.wire import WIRE_VERSION
from tests.coordinators import coordinator


def hello(pid: int, waiting: str = "") -> messages.Hello:
    return messages.Hello(fingerprint={}, pid=pid, host="h", wire=WIRE_VERSION, waiting=waiting)


def test_with_no_producer_it_names_the_unserved_shards():
    co = coordinator(4, 2)
    assert co.wait_line(time.monotonic()) == "0 producer(s) connected; shard(s) 0,1,2,3 wait for a producer"


def test_connected_producers_waiting_on_storage_are_named_with_what_they_wait_on():
    co = coordinator(4, 2)
    retry = "storage (s3://corpora/shards, retry 3 of 7)"
    co._hello(b"a", hello(1, retry))
    co._hello(b"b", hello(2, retry))  # the second: the shards are assigned
    line = co.wait_line(time.monotonic())
    assert line == f"2 producer(s) connected; producer #0 waiting on {retry}; producer #1 waiting on {retry}"
    co._hello(b"a", hello(1))  # its heartbeat: storage answered
    assert co.wait_line(time.monotonic()) == f"2 producer(s) connected; producer #1 waiting on {retry}"


def test_a_peers_waiting_text_is_made_printable_and_bounded():
    co = coordinator(1, 1)
    co._hello(b"a", hello(1, "\x1b[2J" + "x" * 1000))
    line = co.wait_line(time.monotonic())
    assert "\x1b" not in line and "\\x1b[2J" in line and len(line) < 300
