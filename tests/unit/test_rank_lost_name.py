"""A rank killed mid-collective is named even when the collective fails before the killed process has
finished exiting (its sockets close first: CI saw gloo's error win that race)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from lmpipe.consumer.distributed import Dist, RankLost


def two_ranks_here(peer: int) -> Dist:
    """Rank 0 (this process) of a 2-rank job whose rank 1 is `peer`, on this host."""
    return Dist(
        rank=0, world_size=2, peers=[(socket.gethostname(), os.getpid()), (socket.gethostname(), peer)]
    )


def test_a_peer_that_ends_just_after_the_failure_is_still_named():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        d = two_ranks_here(peer.pid)
        lost = d.lost(RuntimeError("Connection reset by peer"))
        assert isinstance(lost, RankLost)
        assert f"rank 1 (pid {peer.pid}) of the torchrun job ended mid-run; rank 0 stops too" in str(lost)
    finally:
        peer.kill()
        peer.wait()


def test_a_failure_with_every_peer_alive_is_not_called_a_lost_rank():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        d = two_ranks_here(peer.pid)
        assert d.lost(RuntimeError("some other failure"), wait=0.1) is None
        assert d.lost(ValueError("not a collective's failure")) is None
    finally:
        peer.kill()
        peer.wait()
