"""Issue 39 item 3: trainer ranks on two hosts (torchrun, c10d rendezvous, gloo on CPU; one rank a host),
fed by producers on three more hosts (tests/netbed.py). A producer host's link is cut, then a trainer host
dies (its torchrun agent and its rank killed): the other host's agent meets again without it, its rank
resumes the last checkpoint alone (the 2-rank checkpoint's shards re-divided over 1), and over the job
every document is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    lmpipe_env,
    wait_until,
)
from tests.netbed import NetBed, NetBedUnavailable

pytestmark = pytest.mark.slow
DOCS, PORT, RDZV = 600, 5555, 29400
TRAINERS, PRODUCERS = ["t0", "t1"], {"p0": "t0", "p1": "t0", "p2": "t1"}  # producer host -> its trainer


def test_two_trainer_hosts_lose_one_and_the_other_trains_every_document_once(tmp_path, tok):
    try:
        bed = NetBed([*TRAINERS, *PRODUCERS], tmp_path).__enter__()
    except NetBedUnavailable as exc:
        pytest.skip(f"no simulated hosts on this machine: {exc}")
    try:
        env = {**lmpipe_env(), "GLOO_SOCKET_IFNAME": "eth0"}
        keys = tmp_path / "keys"
        assert bed.start("t0", "keys", "--out", str(keys), name="keys", env=env).wait(timeout=60) == 0
        ck, log, summary = tmp_path / "ck", tmp_path / "docs.jsonl", tmp_path / "summary.json"
        common = ["--builtin-docs", str(DOCS), "--seq-len", "64", "--batch-size", "4", "--epochs", "1",
                  "--producers", "3", "--curve-dir", str(keys)]  # fmt: skip
        agents = {}
        for host in reversed(TRAINERS):  # t1 first: it waits for t0's rendezvous, so both join one round
            agents[host] = bed.start(
                host, "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{bed['t0'].addr}:{RDZV}", "--rdzv-id", "job", "--local-addr", bed[host].addr,
                "--rdzv-conf", f"is_host={host == 't0'},last_call_timeout=3",
                "-m", "lmpipe", "train", *common, "--port", str(PORT), "--host", "0.0.0.0", "--metrics-port", "-1",
                "--steps", "0", "--threads", "1", "--log-every", "5", "--checkpoint-dir", str(ck),
                "--checkpoint-every", "4", "--resume", "auto", "--doc-log", str(log),
                "--summary-json", str(summary), name=host, env=env, module="torch.distributed.run",
            )  # fmt: skip
        producers = {}
        for host, trainer in PRODUCERS.items():
            rank = TRAINERS.index(trainer)  # the rendezvous ranks hosts by address: t0 is rank 0
            producers[host] = bed.start(
                host, "produce", *common, "--host", bed[trainer].addr, "--port", str(PORT + 2 * rank),
                "--rank", str(rank), "--world-size", "2", "--worker", "-1", "--metrics-port", "-1", name=host,
                env=env,
            )  # fmt: skip
        rank1 = tmp_path / "docs.rank1.jsonl"
        wait_until(lambda: (ck / "step-00000008").is_dir() or agents["t0"].poll() is not None, 180, "step 8")
        bed.cut("p1")  # a producer host of rank 0 drops off; rank 0 trains on p0's batches
        time.sleep(2)
        steps_before = len(doc_log_entries(rank1))
        pids = subprocess.run(["ip", "netns", "pids", bed["t1"].ns], capture_output=True, text=True).stdout
        for pid in pids.split():  # trainer host t1 dies: its agent and its rank
            os.kill(int(pid), signal.SIGKILL)
        wait_until(lambda: "resumed from" in bed.log(agents["t0"]), 120, "t0 to resume alone")
        bed.restore("p1")
        assert agents["t0"].wait(timeout=180) == 0, bed.log(agents["t0"])[-4000:]
        for host in ("p0", "p1"):
            assert producers[host].wait(timeout=30) == 0, bed.log(producers[host])[-2000:]
    finally:
        bed.close()
    text = bed.log(agents["t0"])
    out = json.loads(summary.read_text())
    at = out["first_step"]
    assert out["stopped_by"] == "end of data" and at >= 8, out
    assert out["topology"] == {"world_size": 1, "shards": 32, "shard_space": 32, "resumed_step": at,
                               "resumed_world_size": 2, "restarts": 1}  # fmt: skip
    assert "resuming a checkpoint of 2 ranks on 1" in text
    # rank 0 named the lost rank in one line, and left its producers waiting for the restarted rank
    assert f"the rank at {bed['t1'].addr} (hosts t1) of the torchrun job ended mid-run" in text, text[-4000:]
    assert "Traceback" not in text.partition("resumed from")[0]
    assert "trainer says stop: the trainer failed" not in bed.log(producers["p0"])
    assert steps_before >= at, "rank 1 trained to the checkpoint at least"
    # the killed round's steps from the checkpoint on were trained again; the restarted round, a world of
    # one rank, logs to --doc-log itself
    killed = [e for r in (0, 1) for e in doc_log_entries(tmp_path / f"docs.rank{r}.jsonl") if e["step"] < at]
    entries = killed + doc_log_entries(log)
    assert_exactly_once(doc_pieces(entries), builtin_lengths(tok, DOCS))
