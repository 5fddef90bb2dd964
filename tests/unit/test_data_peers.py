"""Only authenticated producers' data connections count as disconnects: the monitor event sequences
libzmq 4.3 emits (recorded against a CURVE PULL socket) for each kind of peer."""

from __future__ import annotations

import zmq

from lmpipe.consumer.connections import DataPeers

ACC, OK, DISC = zmq.EVENT_ACCEPTED, zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED


def counted(peers: DataPeers, events: list[tuple[int, int]]) -> list[bool]:
    return [peers.event(e, v) for e, v in events]


def test_peers_that_never_authenticated_are_not_counted():
    peers = DataPeers()
    plain = [(ACC, 21), (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 285212674), (DISC, 21)]  # NULL at CURVE
    raw_close = [(ACC, 20), (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104), (DISC, 20)]
    raw_garbage = [(ACC, 20), (DISC, 20)]  # no handshake event at all
    wrong_key = [(ACC, 21), (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), (DISC, 21)]
    for seq in (plain, raw_close, raw_garbage, wrong_key):
        assert not any(counted(peers, seq))
    assert not peers.pending and not peers.authed and peers.unclaimed == 0


def test_an_authenticated_producer_is_counted_once():
    peers = DataPeers()
    assert counted(peers, [(ACC, 21), (OK, 0), (DISC, 21)]) == [False, False, True]


def test_a_scanner_beside_a_handshaking_producer_does_not_count():
    peers = DataPeers()
    assert counted(peers, [(ACC, 5), (ACC, 6), (OK, 0), (DISC, 6), (DISC, 5)]) == [False] * 4 + [True]


def test_a_delivered_message_says_whose_handshake_succeeded():
    peers = DataPeers()
    counted(peers, [(ACC, 5), (ACC, 6), (OK, 0)])
    peers.delivered(6)
    assert counted(peers, [(DISC, 5), (DISC, 6)]) == [False, True]


def test_a_message_read_before_its_accepted_event():
    peers = DataPeers()
    peers.delivered(7)
    assert counted(peers, [(ACC, 7), (OK, 0), (DISC, 7)]) == [False, False, True]
    assert not peers.pending and not peers.authed
