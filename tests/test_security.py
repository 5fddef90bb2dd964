"""Network safety: loopback by default, CURVE keys admit only authorized producers."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.trainer import Trainer
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.security import generate_keys

pytestmark = pytest.mark.slow

COMMON = ["--producers", "1", "--builtin-docs", "200", "--metrics-port", "-1", "--epochs", "1"]


def test_non_loopback_bind_needs_keys_or_an_explicit_flag():
    with pytest.raises(ValueError, match="refusing to bind 0.0.0.0.*--curve-dir.*--trusted-network"):
        Trainer(PipelineConfig(host="0.0.0.0"), TrainConfig())


def test_curve_admits_only_authorized_producers(procs, tmp_path, port):
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
    plain = procs.start("produce", *COMMON, "--port", str(port), name="plain")
    other = procs.start("produce", *COMMON, *net, str(stranger), name="stranger")
    time.sleep(4)
    for p in (plain, other):
        assert "joined" not in procs.log(p) and p.poll() is None, procs.log(p)
    assert "joined" not in procs.log(train)
    good = procs.start("produce", *COMMON, *net, str(keys), name="good")
    assert train.wait(timeout=120) == 0, procs.log(train)
    assert "joined session" in procs.log(good)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["tokens"] > 0
