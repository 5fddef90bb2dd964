"""The parts of an elastic restart under torchrun (issue 39 item 2) that need no job: the store a restarted
round's ranks meet in, the restart count in the summary, and a rank's metrics port left off."""

from __future__ import annotations

import datetime
import socket
import threading

import torch.distributed as dist

from lmpipe.consumer.config import TrainConfig, per_rank
from lmpipe.consumer.distributed import ROUND_KEY, round_store
from lmpipe.consumer.report import Summary
from lmpipe.consumer.reshard import plan, said
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics


def test_a_restarted_round_meets_in_its_own_store_not_at_the_killed_rounds_address(monkeypatch):
    # torchrun's agent store, as the killed round left it: rank 0's address there is dead
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    agent.set(ROUND_KEY, f"127.0.0.1 {dead}")
    agent.set("default_pg/0//rank_1", "the killed round's rank 1")  # what gloo read and failed to reach
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    timeout = datetime.timedelta(seconds=30)
    got: list = []
    one = threading.Thread(target=lambda: got.append(round_store(1, timeout)))
    one.start()  # reads the dead address first, and again until rank 0 has said its own
    zero = round_store(0, timeout)
    one.join(30)
    assert got and got[0] is not None
    zero.set("k", "this round")
    assert got[0].get("k") == b"this round"
    assert not got[0].check(["default_pg/0//rank_1"])  # a fresh store: none of the killed round's keys
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert round_store(0, timeout) is None  # torch's rendezvous is fresh each round: used as it is


def test_the_summary_and_the_metrics_say_torchruns_restart():
    metrics = TrainerMetrics()
    said(plan(None, 0, 2, 16), 1, 4, metrics, main=True, restarts=1)
    assert metrics.registry.get_sample_value("lmpipe_trainer_restarts") == 1.0
    s = Summary(steps=20, first_step=6, seconds=1.0, first_loss=5.0, last_loss=4.0, stopped_by="end of data")
    s.topology = {"world_size": 2, "shards": 16, "shard_space": 32, "resumed_step": 6, "resumed_world_size": 2,
                  "restarts": 1}  # fmt: skip
    assert "(steps 7-20: resumed at 6, after torchrun's restart 1)" in s.render()


def test_metrics_off_stay_off_on_every_rank():
    _, tcfg = per_rank(PipelineConfig(producers=1), TrainConfig(metrics_port=-1), 1, 2)
    assert tcfg.metrics_port == -1  # was -1 + 1 x 2: rank 1 served its metrics on port 1
