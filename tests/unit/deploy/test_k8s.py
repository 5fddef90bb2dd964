"""deploy/k8s, checked statically (no Kubernetes cluster runs on this project's machines): every manifest
against the Kubernetes API's OpenAPI schemas (kubernetes-validate, which bundles them: nothing is fetched),
KEDA's ScaledObject against its fields (tests/data/keda-scaledobject.schema.json), the references between
the objects, every metric the autoscaler names against shared/metrics.py, and the autoscaling query itself
with `promtool test rules` (what it asks for when the trainer starves, when producers are blocked, when
the run is balanced). tests/e2e/deploy/test_k8s.py runs the containers' commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from lmpipe.cli import build_parser
from tests.deploy.exported import sample_names
from tests.deploy.k8s import (
    by_kind,
    container_argv,
    flag,
    manifests,
    metric_names,
    pod_spec,
    scaler_queries,
    settings_env,
)
from tests.helpers import REPO

K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are written for (Indexed Job pod hostnames: 1.22)
KEDA_SCHEMA = REPO / "tests" / "data" / "keda-scaledobject.schema.json"
TRAINER_ENTRYPOINT = ["lmpipe", "train"]
PRODUCER_ENTRYPOINT = ["lmpipe", "produce"]


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="the dev extra's kubernetes-validate")
    docs = manifests()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Job", "PersistentVolumeClaim", "ScaledObject", "Service"]
    for d in docs:
        if d["apiVersion"] == "keda.sh/v1alpha1":
            jsonschema.validate(d, json.loads(KEDA_SCHEMA.read_text()))
        else:  # strict: a misspelt or misplaced field is an error, as `kubectl apply --validate=strict`
            kv.validate(d, K8S_VERSION, strict=True)


def test_a_misplaced_field_is_caught():
    kv = pytest.importorskip("kubernetes_validate", reason="the dev extra's kubernetes-validate")
    job = by_kind(manifests(), "Job")
    pod_spec(job)["containers"][0]["envFrom"][0]["configMap"] = {"name": "x"}  # configMapRef's wrong name
    with pytest.raises(kv.ValidationError):
        kv.validate(job, K8S_VERSION, strict=True)
    scaled = by_kind(manifests(), "ScaledObject")
    scaled["spec"]["maxReplicas"] = 4  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, json.loads(KEDA_SCHEMA.read_text()))


def test_the_objects_refer_to_each_other():
    docs = manifests()
    svc, job = by_kind(docs, "Service"), by_kind(docs, "Job")
    deploy, scaled = by_kind(docs, "Deployment"), by_kind(docs, "ScaledObject")
    trainer_labels = job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= trainer_labels.items()
    assert (
        job["spec"]["completionMode"] == "Indexed" and pod_spec(job)["subdomain"] == svc["metadata"]["name"]
    )
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    t_argv, p_argv = container_argv(job, TRAINER_ENTRYPOINT), container_argv(deploy, PRODUCER_ENTRYPOINT)
    # producers dial the trainer's pod 0 by the name the Job and the headless Service give it
    rank0 = f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert flag(p_argv, "--host") == rank0 and flag(t_argv, "--master-addr") == rank0
    assert flag(t_argv, "--nnodes") == str(job["spec"]["completions"])
    port = int(settings_env(docs)["LMPIPE_PORT"])
    svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert svc_ports["data"] == port and svc_ports["control"] == port + 1
    assert svc_ports["rendezvous"] == int(flag(t_argv, "--master-port"))
    # keys: one Secret; the trainer gets its pair and the producers' public key, producers their secret key
    for workload, files in ((job, {"server.key", "server.key_secret", "authorized/client.key"}),
                            (deploy, {"client.key_secret", "server.key"})):  # fmt: skip
        vols = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in pod_spec(workload)["containers"][0]["volumeMounts"]}
        keys = vols["keys"]["secret"]
        assert keys["secretName"] == "lmpipe-keys" and {i["path"] for i in keys["items"]} == files
        assert flag(container_argv(workload, []), "--curve-dir") == mounts["keys"]
        assert pod_spec(workload)["containers"][0]["envFrom"][0]["configMapRef"]["name"] == "lmpipe-settings"
    ck = by_kind(docs, "PersistentVolumeClaim")["metadata"]["name"]
    vols = {v["name"]: v for v in pod_spec(job)["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod_spec(job)["containers"][0]["volumeMounts"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == ck
    assert flag(t_argv, "--checkpoint-dir") == mounts["checkpoints"] and flag(t_argv, "--resume") == "auto"
    # the autoscaler drives the producers, up to the number of shards (more would stand by)
    assert scaled["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert scaled["spec"]["maxReplicaCount"] == int(settings_env(docs)["LMPIPE_SHARDS"])
    assert "replicas" in deploy["spec"] and deploy["spec"]["selector"]["matchLabels"].items() <= (
        deploy["spec"]["template"]["metadata"]["labels"].items()
    )


def test_prometheus_scrapes_the_ports_lmpipe_serves_and_the_probes_read_them():
    docs = manifests()
    for workload, entry in ((by_kind(docs, "Job"), TRAINER_ENTRYPOINT),
                            (by_kind(docs, "Deployment"), PRODUCER_ENTRYPOINT)):  # fmt: skip
        argv = container_argv(workload, entry)
        ann = workload["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert (
            ann["prometheus.io/port"] == flag(argv, "--metrics-port")
            and flag(argv, "--metrics-host") == "0.0.0.0"
        )
        c = pod_spec(workload)["containers"][0]
        for probe in ("livenessProbe", "readinessProbe"):
            if probe in c:
                cmd = c[probe]["exec"]["command"]
                assert cmd[:2] == ["lmpipe", "health"] and flag(cmd, "--metrics-port") == flag(
                    argv, "--metrics-port"
                )


def test_the_commands_parse_with_the_settings_lmpipe_reads(monkeypatch):
    """The containers' argv through lmpipe's own parser, with the ConfigMap as the environment: both sides
    read the same batching settings, and every variable of the ConfigMap is a setting of one of them."""
    docs = manifests()
    env = settings_env(docs)
    t_argv = container_argv(by_kind(docs, "Job"), TRAINER_ENTRYPOINT)
    lm = t_argv.index("lmpipe")
    assert t_argv[:3] == ["python", "-m", "torch.distributed.run"] and t_argv[lm - 1] == "-m"
    p_argv = container_argv(by_kind(docs, "Deployment"), PRODUCER_ENTRYPOINT)
    assert p_argv[:2] == PRODUCER_ENTRYPOINT
    for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # lmpipe's parser reads LMPIPE_* defaults when it is built; argparse exits on an unknown flag or value
    train = build_parser().parse_args(t_argv[lm + 1 :])
    produce = build_parser().parse_args(p_argv[1:])
    for var in env:
        dest = var.removeprefix("LMPIPE_").lower()
        assert hasattr(train, dest) or hasattr(produce, dest), f"{var} is no setting of train or produce"
        if hasattr(train, dest) and hasattr(produce, dest):
            assert getattr(train, dest) == getattr(produce, dest), var
    assert train.seq_len == int(env["LMPIPE_SEQ_LEN"]) and produce.strategy == env["LMPIPE_STRATEGY"]
    assert produce.worker == -1 and train.resume == "auto"


def test_every_metric_the_autoscaler_names_is_exported():
    known = sample_names()
    queries = scaler_queries(manifests())
    assert queries
    for q in queries:
        names = metric_names(q)
        assert names and not names - set(known), f"not in shared/metrics.py: {sorted(names - set(known))}"
        assert "lmpipe_trainer_data_waiting_seconds_total" in names, "scaled on the trainer's data wait"


def _rule_test(tmp_path, series: dict[str, str], want: float) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no `promtool`: install Debian's prometheus package (.ci/run does)")
    (query,) = scaler_queries(manifests())
    rules = {"groups": [{"name": "k8s", "rules": [{"record": "lmpipe:producers_wanted", "expr": query}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "promql_expr_test": [{"expr": "lmpipe:producers_wanted", "eval_time": "10m",
                                  "exp_samples": [{"labels": "lmpipe:producers_wanted", "value": want}]}],
        }],
    }  # fmt: skip
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    return subprocess.run(
        [promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "case, wait_per_min, blocked_per_min, want",
    [
        ("starved: data wait 40% of the time", 24, 0, 2 / 0.6),
        # no step ends: a ratio over the step time was 0/0 here, and KEDA saw no value at all
        ("starved of every batch", 60, 0, 2 / 0.2),
        ("producers blocked half the time", 0, 30, 1),
        ("balanced", 0, 0, 2),
    ],
)
def test_the_autoscaling_query_asks_for_the_producers_the_trainer_needs(
    tmp_path, case, wait_per_min, blocked_per_min, want
):
    """2 producers connected; the trainer steps 60 s a minute (step time includes the wait)."""
    series = {
        'lmpipe_trainer_producers_connected{job="trainer"}': "2+0x20",
        'lmpipe_trainer_step_seconds_sum{job="trainer"}': "0+60x20",
        'lmpipe_trainer_data_waiting_seconds_total{job="trainer"}': f"0+{wait_per_min}x20",
        'lmpipe_producer_send_blocked_seconds_total{job="producer",producer="0"}': f"0+{blocked_per_min}x20",
        'lmpipe_producer_send_blocked_seconds_total{job="producer",producer="1"}': f"0+{blocked_per_min}x20",
    }
    r = _rule_test(tmp_path, series, want)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, f"{case}: {r.stdout}{r.stderr}"
