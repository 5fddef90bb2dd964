"""The library's Loader (lmpipe/loader.py) in a user's own process, with real producer processes: a kill -9
of the user's process and a resume from the user's own checkpoint trains every document exactly once; two
torchrun ranks read disjoint shares; no process outlives the `with` block, whatever ends it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    free_ports,
    lmpipe_env,
    trained_pieces,
    wait_until,
)

DOCS = 300
# A user's script: MODE "crash" saves the loader's state in its own checkpoint every 4 batches and kills
# itself (SIGKILL) at batch 13; "resume" goes on from that checkpoint to the end of the epoch; "raise" and
# "wait" (endless, slowly) show what ends a `with` block (an exception; Ctrl-C, a dead producer).
USER = """
import json, os, signal, sys, time
import torch
from lmpipe import Loader

mode, port, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ckpt = os.path.join(tmp, "ckpt.pt")
loader = Loader(seq_len=64, batch_size=4, producers=2, shards=4, epochs=0 if mode == "wait" else 1,
                builtin_docs=DOCS, port=port, device="cpu", doc_log=os.path.join(tmp, "docs.jsonl"))
if mode == "resume":
    loader.load_state_dict(torch.load(ckpt, weights_only=True)["loader"])
n = 0
with loader:
    print(json.dumps({"pids": loader.producer_pids}), flush=True)
    try:
        for batch in loader:
            n += 1
            if mode == "crash" and n % 4 == 0:
                torch.save({"loader": loader.state_dict(), "step": n}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            if mode == "crash" and n == 13:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise" and n == 3:
                raise ValueError("the user's loop failed")
            if mode == "wait" and n == 3:
                print("waiting", flush=True)
            if mode == "wait":
                time.sleep(0.05)
    except RuntimeError as exc:
        print("stopped:", exc, flush=True)
        sys.exit(3)
if "WORLD_SIZE" in os.environ:  # a torchrun job: the ranks train together (gloo on CPU)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor(n)
    dist.all_reduce(total)
    print(json.dumps({"rank": dist.get_rank(), "batches": n, "job": int(total)}), flush=True)
    dist.destroy_process_group()
""".replace("DOCS", str(DOCS))


def start(tmp: Path, mode: str, port: int, nproc: int = 0) -> subprocess.Popen:
    script = tmp / "user.py"
    script.write_text(USER)
    env = {**lmpipe_env(), "PYTHONPATH": str(REPO)}
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    )
    return subprocess.Popen([sys.executable, *launcher, str(script), mode, str(port), str(tmp)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out, err


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pids_of(out: str) -> list[int]:
    return next(json.loads(line)["pids"] for line in out.splitlines() if line.startswith('{"pids"'))


def test_kill_9_of_the_users_process_and_a_resume_from_its_checkpoint_trains_every_document_once(
    tmp_path, tok
):
    port = free_ports(2)
    rc, out, err = finish(start(tmp_path, "crash", port))
    assert rc == -signal.SIGKILL, err[-3000:]
    for pid in pids_of(out):  # --exit-with-parent: the producers go by themselves
        wait_until(lambda pid=pid: not alive(pid), 15, f"producer {pid} to quit after its parent's kill -9")
    resumed = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]["batches"]
    assert resumed == 12
    rc, out, err = finish(start(tmp_path, "resume", port))
    assert rc == 0, err[-3000:]
    entries = doc_log_entries(tmp_path / "docs.jsonl")
    first = entries[0]["batches"][0]["session"]
    assert_exactly_once(trained_pieces(entries, first, resumed), builtin_lengths(tok, DOCS))


def test_two_torchrun_ranks_read_disjoint_shares(tmp_path, tok):
    rc, out, err = finish(start(tmp_path, "all", free_ports(4), nproc=2), timeout=180)
    assert rc == 0, err[-3000:]
    said = [json.loads(x) for x in re.findall(r'\{"rank": [^}]*\}', out)]  # the ranks share one stdout
    assert sorted(s["rank"] for s in said) == [0, 1] and said[0]["job"] == sum(s["batches"] for s in said)
    logs = sorted(tmp_path.glob("docs.rank*.jsonl"))
    assert len(logs) == 2
    per_rank = [doc_pieces(doc_log_entries(p)) for p in logs]
    assert all(per_rank) and not set(per_rank[0]) & set(per_rank[1]), "each rank has its own documents"
    assert_exactly_once({**per_rank[0], **per_rank[1]}, builtin_lengths(tok, DOCS))


@pytest.mark.parametrize("how", ["exception", "ctrl-c", "dead producer"])
def test_no_process_outlives_the_with_block(tmp_path, how):
    p = start(tmp_path, "raise" if how == "exception" else "wait", free_ports(2))
    assert p.stdout is not None
    pids = pids_of(p.stdout.readline())
    if how != "exception":
        assert p.stdout.readline().strip() == "waiting"
        os.kill(pids[0], signal.SIGKILL) if how == "dead producer" else os.kill(p.pid, signal.SIGINT)
    rc, out, err = finish(p, timeout=60)
    expected = {"exception": "ValueError: the user's loop failed", "ctrl-c": "KeyboardInterrupt",
                "dead producer": "stopped: producer 0 exited with code -9; the loader stopped"}  # fmt: skip
    assert rc != 0 and expected[how] in out + err, err[-3000:]
    assert not [pid for pid in pids if alive(pid)], "the producers were reaped before the process exited"
