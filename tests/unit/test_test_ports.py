"""The test suite's port reservations (tests/helpers.py): a trainer on the default transport listens on
ipc://.../<port>.data and leaves the TCP port free, so a free TCP port alone let both xdist workers be handed
the same number, and a trainer could admit the other worker's producers and wait 60 s for their bye (one way
a trainer stopped in CI could have outlived the test's 60 s)."""

import socket

from tests import helpers


def test_a_port_handed_out_once_is_not_handed_out_again_in_the_session(monkeypatch, tmp_path):
    monkeypatch.setenv(helpers.PORTS_DIR, str(tmp_path))
    real_socket = socket.socket
    picks = iter([41000, 41000, 41001, 41003])  # bind(0) hands out 41000 twice, then one inside its range

    class Picked(real_socket):
        def getsockname(self):
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(helpers.socket, "socket", Picked)
    assert helpers.free_ports(2) == 41000
    assert helpers.free_ports(2) == 41003  # 41000 again, and 41001 (its range holds 41001 too), are refused
    assert sorted(int(f.name) for f in tmp_path.iterdir()) == [41000, 41001, 41003, 41004]


def test_a_refused_range_gives_back_what_it_claimed(monkeypatch, tmp_path):
    monkeypatch.setenv(helpers.PORTS_DIR, str(tmp_path))
    (tmp_path / "41002").touch()
    assert not helpers._reserve(range(41000, 41003))
    assert [f.name for f in tmp_path.iterdir()] == ["41002"]
