"""deploy/k8s's containers, run as local processes (no Kubernetes cluster runs on this project's machines):
the trainer Job's command line (torchrun, rank 0 of 1 node) and two replicas of the producer Deployment's,
with the ConfigMap as their environment, the Secret's files laid out as its `items` mount them, and the
cluster names replaced by loopback. They train one epoch with every document once; meanwhile the pods'
probe commands pass and every metric the autoscaler's query names is served with samples."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmpipe.consumer.checkpoint import CheckpointManager
from tests.deploy.k8s import by_kind, container_argv, manifests, pod_spec, scaler_queries, settings_env
from tests.deploy.scrape import wait_for_scrape
from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    free_ports,
    lmpipe_env,
    read_doc_log,
    steps_logged,
    wait_until,
)

pytestmark = pytest.mark.slow
DOCS = 400


def lay_out_secret(workload: dict, keys: Path, dest: Path) -> Path:
    """The `keys` volume as the kubelet mounts it: each item's key (a file of `lmpipe keys`) at its path."""
    (vol,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == "keys"]
    for item in vol["secret"]["items"]:
        target = dest / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((keys / item["key"]).read_bytes())
        target.chmod(vol["secret"]["defaultMode"])
    return dest


def local_argv(argv: list[str], subst: dict[str, str]) -> list[str]:
    """The container's argv on this machine: `python` / `lmpipe` become this interpreter, cluster names,
    mount paths and ports become local ones (`subst`, applied to every `--flag=value`'s value too), and
    Kubernetes's $(VAR) references are expanded from `subst`."""
    exe = {"python": [sys.executable], "lmpipe": [sys.executable, "-m", "lmpipe"]}
    out = list(exe.get(argv[0], [argv[0]]))
    for a in argv[1:]:
        a = re.sub(r"\$\((\w+)\)", lambda m: subst[m[1]], a)
        if a.startswith("--") and "=" in a:
            name, value = a.split("=", 1)
            a = f"{name}={subst.get(value, value)}"
        else:
            a = subst.get(a, a)
        out.append(a)
    return out


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        p = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    p.log_path = log  # type: ignore[attr-defined]
    return p


def text(p: subprocess.Popen) -> str:
    return Path(p.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def test_the_manifests_commands_train_an_epoch_with_every_document_once(tmp_path, port, tok):
    docs = manifests()
    job, deploy = by_kind(docs, "Job"), by_kind(docs, "Deployment")
    keys = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "lmpipe", "keys", "--out", str(keys)], cwd=REPO, check=True,
                   capture_output=True, env=lmpipe_env())  # fmt: skip
    ck, log = tmp_path / "checkpoints", tmp_path / "docs.jsonl"
    base = free_ports(2 + deploy["spec"]["replicas"], avoid={port, port + 1})
    t_metrics, rdzv, *p_metrics = range(base, base + 2 + deploy["spec"]["replicas"])
    env = {**lmpipe_env(), **settings_env(docs), "PYTHONPATH": str(REPO)}
    # a small run on CPU: the same settings but the model and the corpus's size
    env.update(LMPIPE_MODEL="tiny", LMPIPE_SEQ_LEN="64", LMPIPE_BATCH_SIZE="4", LMPIPE_BUILTIN_DOCS=str(DOCS),
               LMPIPE_PORT=str(port), LMPIPE_CHECKPOINT_EVERY="10", LMPIPE_THREADS="1",
               LMPIPE_DOC_LOG=str(log), LMPIPE_LOG_EVERY="10", LMPIPE_METRICS_LINGER="0")  # fmt: skip
    cluster = {"lmpipe-trainer-0.lmpipe-trainer": "127.0.0.1", "29400": str(rdzv), "/checkpoints": str(ck),
               "9400": str(t_metrics), "NODE_RANK": "0"}  # fmt: skip
    t_keys = lay_out_secret(job, keys, tmp_path / "trainer-keys")
    trainer_argv = local_argv(container_argv(job, []), {**cluster, "/keys": str(t_keys)})
    procs = [start(trainer_argv, env, tmp_path / "trainer.log")]
    try:
        p_keys = lay_out_secret(deploy, keys, tmp_path / "producer-keys")
        for i, mport in enumerate(p_metrics):
            argv = local_argv(["lmpipe", "produce", *container_argv(deploy, [])],
                              {**cluster, "/keys": str(p_keys), "9401": str(mport)})  # fmt: skip
            procs.append(start(argv, env, tmp_path / f"producer{i}.log"))
        trainer, producers = procs[0], procs[1:]
        wait_until(lambda: steps_logged(log) >= 5 or trainer.poll() is not None, 120, "5 steps")
        assert trainer.poll() is None, text(trainer)[-3000:]

        # what the pods' probes run, against these processes
        for workload, mport in ((job, t_metrics), *((deploy, m) for m in p_metrics)):
            c = pod_spec(workload)["containers"][0]
            for probe in ("livenessProbe", "readinessProbe"):
                if probe in c:
                    cmd = local_argv(
                        c[probe]["exec"]["command"], {"9400": str(t_metrics), "9401": str(mport)}
                    )
                    r = subprocess.run(
                        cmd, capture_output=True, text=True, env=lmpipe_env(), cwd=REPO, timeout=60
                    )
                    assert r.returncode == 0, f"{probe} of {workload['kind']}: {r.stdout}{r.stderr}"
        # every metric the autoscaler's query reads is served, with samples
        served = wait_for_scrape(t_metrics).names() | set().union(
            *(wait_for_scrape(m).names() for m in p_metrics)
        )
        for q in scaler_queries(docs):
            for name in re.findall(r"\blmpipe_[a-z0-9_]+", q):
                assert name in served, f"{name} (autoscaling query) is not served"

        assert trainer.wait(timeout=240) == 0, text(trainer)[-3000:]
        for p in producers:
            assert p.wait(timeout=30) == 0, text(p)[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = text(trainer)
    assert "(end of data)" in out and out.count("joined from") == len(p_metrics), out[-3000:]
    assert CheckpointManager(ck).latest_step(), "checkpoints in the volume's path"
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, DOCS))
