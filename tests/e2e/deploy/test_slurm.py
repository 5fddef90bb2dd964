"""deploy/slurm on a real Slurm: slurmctld and one slurmd per simulated host (tests/slurmbed.py).

The shipped batch script runs as users run it: a heterogeneous job (trainer on the `gpu` node under srun +
torchrun, one producer on each of two `cpu` nodes), keys, checkpoints and the doc-log in the job's folder on
shared storage. Mid-run a producer node is drained and its producer step cancelled, as an administrator
takes a node out; a producer job (deploy/slurm/join.sbatch) joins the running trainer; then the job is
requeued (`scontrol requeue`, as preemption does), Slurm starts it again on the nodes still in service, the
trainer resumes from its checkpoint (`--resume auto`), and the epoch ends with every document trained once.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from lmpipe.consumer.checkpoint import CheckpointManager
from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    lmpipe_env,
    steps_logged,
    trained_pieces,
    wait_until,
)
from tests.slurmbed import SlurmBed, SlurmUnavailable

pytestmark = pytest.mark.slow

SLURM = REPO / "deploy" / "slurm"
DOCS = 500  # about 240 steps: the drain, the join and the requeue come before step 100


@pytest.fixture
def cluster(tmp_path):
    c = SlurmBed(tmp_path, {"gpu": ["t0"], "cpu": ["p0", "p1", "p2"]})
    try:
        c.__enter__()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm test cluster here: {exc}")
    try:
        yield c
    finally:
        c.close()


def job_env(run: Path) -> dict[str, str]:
    """What a user exports before `sbatch`: lmpipe's settings and the job's folder on shared storage."""
    env = lmpipe_env()
    env.update(
        PYTHONPATH=str(REPO),
        LMPIPE_SLURM_DIR=str(run),
        LMPIPE_SLURM_PYTHON=sys.executable,
        LMPIPE_BUILTIN_DOCS=str(DOCS),
        LMPIPE_SEQ_LEN="64",
        LMPIPE_BATCH_SIZE="4",
        LMPIPE_EPOCHS="1",
        LMPIPE_SHARDS="8",
        LMPIPE_STEPS="0",
        LMPIPE_THREADS="1",
        LMPIPE_LOG_EVERY="10",
        LMPIPE_CHECKPOINT_EVERY="10",
        LMPIPE_DOC_LOG=str(run / "docs.jsonl"),
        LMPIPE_METRICS_PORT="-1",
    )
    return env


def steps_of(cluster: SlurmBed, job: str) -> dict[str, str]:
    """Running steps of `job` and its components: {step name: step id}."""
    out = cluster.run("squeue", "-h", "-s", "-o", "%i %j").stdout  # a component's steps go by its own id
    return {name: sid for sid, name in (line.split() for line in out.splitlines() if line.strip())}


def nodes_of(cluster: SlurmBed, job: str) -> list[str]:
    """The nodes of the producer component (component 1 of the heterogeneous job)."""
    for line in cluster.run("scontrol", "-o", "show", "job", job).stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if fields.get("HetJobOffset") == "1":
            return cluster.run("scontrol", "show", "hostnames", fields["NodeList"]).stdout.split()
    return []


def test_the_batch_script_survives_a_drained_node_and_a_requeue_and_trains_every_document_once(
    cluster, tmp_path, tok
):
    t0 = time.monotonic()
    run = tmp_path / "run"  # the job's shared storage: every node sees it
    env = job_env(run)
    log, ck = run / "docs.jsonl", CheckpointManager(run / "checkpoints")
    out = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/job.out", f"--chdir={REPO}",
                      str(SLURM / "lmpipe.sbatch"), env=env).stdout  # fmt: skip
    job = out.strip().split(";")[0]

    def train_log(restart: int) -> str:
        p = run / "logs" / f"train-{job}.{restart}.out"
        return p.read_text(errors="replace") if p.exists() else ""

    def diag() -> str:
        job_out = tmp_path / "job.out"
        return (job_out.read_text() if job_out.exists() else "") + train_log(0)[-3000:] + train_log(1)[-3000:]

    wait_until(lambda: steps_logged(log) >= 10 and ck.latest_step(), 120, "10 steps and a checkpoint")
    first = nodes_of(cluster, job)
    assert len(first) == 2 and "t0" not in first, first
    assert train_log(0).count("joined from") == 2, diag()

    # an administrator takes a producer node out: drain it, cancel its producer step
    drained = first[1]
    cluster.run("scontrol", "update", f"nodename={drained}", "state=drain", "reason=maintenance")
    steps = steps_of(cluster, job)
    assert f"produce-{drained}" in steps, steps
    cluster.run("scancel", steps[f"produce-{drained}"])
    wait_until(lambda: "left" in train_log(0), 30, "the trainer to see the producer leave")
    at = steps_logged(log)
    wait_until(lambda: steps_logged(log) >= at + 10, 60, "10 steps on the producer left")

    # more producers join the running trainer from a job of their own
    join = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/join.out", f"--chdir={REPO}",
                       str(SLURM / "join.sbatch"), env={**env, "LMPIPE_SLURM_TRAINER_JOB": job}).stdout.strip()  # fmt: skip
    wait_until(lambda: train_log(0).count("joined from") == 3, 60, "the joining producer")

    # preemption: the job goes back to the queue and starts again on nodes in service
    wait_until(lambda: (ck.latest_step() or 0) > at, 60, "a checkpoint after the drain")
    assert "all 8 shards finished" not in train_log(0), "the epoch is still running"
    cluster.run("scontrol", "requeue", job)
    wait_until(lambda: "resumed from" in train_log(1), 120, "the requeued job to resume")
    wait_until(lambda: cluster.job(job)["JobState"] == "COMPLETED", 120, "the requeued job to end")
    wait_until(
        lambda: cluster.job(join)["JobState"] in ("COMPLETED", "FAILED"), 30, "the producer job to end"
    )
    text = train_log(1)
    started = re.findall(
        r"\(restart (\d)\): trainer t0 \(1 ranks\), producers (.*)", (tmp_path / "job.out").read_text()
    )
    assert [r for r, _ in started] == ["0", "1"] and drained not in started[1][1].split(), started
    assert "(end of data)" in text and "all 8 shards finished" in text, diag()
    assert cluster.job(job)["Restarts"] == "1"
    resumed = int(re.search(r"resumed from \S+: step (\d+)", text).group(1))
    entries = doc_log_entries(log)
    first_session = entries[0]["batches"][0]["session"]
    assert_exactly_once(trained_pieces(entries, first_session, resumed), builtin_lengths(tok, DOCS))
    print(f"slurm: {steps_logged(log)} steps, resumed at {resumed}, {time.monotonic() - t0:.1f} s")
