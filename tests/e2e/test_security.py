"""Network safety: private Unix sockets by default, CURVE keys admit only authorized producers.

The attacks of issue 10, run by a hostile client against real processes, are in tests/e2e/test_hostile.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lmpipe.shared.security import generate_keys

COMMON = ["--producers", "1", "--builtin-docs", "200", "--metrics-port", "-1", "--epochs", "1"]


def test_producer_to_another_host_needs_keys_or_an_explicit_flag(procs):
    p = procs.start("produce", *COMMON, "--host", "192.0.2.1", name="producer")
    assert p.wait(timeout=60) == 2
    assert "refusing to connect to 192.0.2.1 unencrypted" in procs.log(p)
    assert "Traceback" not in procs.log(p)


@pytest.mark.slow
def test_curve_admits_only_authorized_producers(procs, tmp_path, port):
    """Keyless and unauthorized producers connect at the same time as the authorized one: they exit with
    the reason, and they never hold up its batches (they used to: the receive loop died on a spurious
    zmq.Again while their handshakes kept the data socket busy, and the trainer waited forever)."""
    keys = generate_keys(tmp_path / "keys")
    stranger = tmp_path / "stranger"  # a valid key pair the trainer has never authorized
    generate_keys(stranger)
    shutil.copy(keys / "server.key", stranger / "server.key")
    summary = tmp_path / "s.json"
    net = ["--port", str(port), "--curve-dir"]
    train = procs.start(
        "train", *COMMON, *net, str(keys), "--steps", "0", "--summary-json", str(summary), name="trainer"
    )
    procs.wait_for(train, "listening on")
    # tcp without keys (as --trusted-network means) against a trainer that wants them
    # debug: its log names every handshake event, should it ever wait again (it did, once in ~60 runs)
    plain = procs.start(
        "produce", *COMMON, "--port", str(port), "--trusted-network", "--log-level", "debug", name="plain"
    )
    other = procs.start("produce", *COMMON, *net, str(stranger), name="stranger")
    good = procs.start("produce", *COMMON, *net, str(keys), name="good")
    assert procs.wait(plain) == 2, procs.log(plain)
    assert "cannot connect: the trainer at tcp://127.0.0.1:" in procs.log(plain)
    assert "requires CURVE keys" in procs.log(plain) and "pass --curve-dir" in procs.log(plain)
    assert procs.wait(other) == 2, procs.log(other)
    assert "does not accept this producer's CURVE key" in procs.log(other)
    assert procs.wait(train, 120) == 0, procs.log(train)
    assert "joined the trainer" in procs.log(good)
    for p in (plain, other):
        assert "joined" not in procs.log(p) and "Traceback" not in procs.log(p)
    assert procs.log(train).count("joined from") == 1
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["tokens"] > 0
    assert out["rejected"] == 0 and out["stale"] == 0
