"""A real Prometheus (Debian's package) scraping the compose services' own `lmpipe train` / `lmpipe produce`
commands, run here as local processes, through a config rendered from the template of the shipped one; then
every PromQL expression of the Grafana dashboard must return data. And the shipped config: the template's
rendering for compose, accepted by promtool."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from lmpipe.shared.metrics import REFUSAL_REASONS
from lmpipe.shared.tokenizer import load_tokenizer
from tests.deploy.compose import interpolate, load_compose, service_argv, service_env
from tests.deploy.dashboard import dashboard_exprs, empty_allowed, expand, nan_allowed
from tests.deploy.shipped import COMPOSE, render_prometheus
from tests.helpers import free_port_pair, free_ports, lmpipe_env


def prom_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_prometheus_scrapes_the_compose_commands_and_every_dashboard_query_returns_data(procs, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("no `prometheus` binary: install Debian's prometheus package (.ci/run does)")
    services = load_compose(COMPOSE)["services"]
    trainer_svc, producer_svc = services["trainer"], services["producer"]
    # checkpoints in this test's folder, every 5 steps, so that the checkpoint panel has data
    ckpt = {"LMPIPE_CHECKPOINT_DIR": str(tmp_path / "ck"), "LMPIPE_CHECKPOINT_EVERY": "5"}
    env = {**lmpipe_env(), **service_env(trainer_svc), **ckpt}
    n = int(interpolate(producer_svc["scale"], {}))
    data_port = free_port_pair()
    base = free_ports(n + 2, avoid={data_port, data_port + 1})
    trainer_port, producer_ports, prom_port = base, [base + 1 + i for i in range(n)], base + n + 1

    # The compose commands, with only the addresses changed for loopback (argparse: the last flag wins).
    local = ["--host", "127.0.0.1", "--port", str(data_port), "--runtime-dir", str(tmp_path / "run")]
    argv = service_argv(trainer_svc)
    assert argv[0] == "lmpipe"
    procs.start(*argv[1:], *local, "--metrics-port", str(trainer_port), name="trainer", env=env)
    for i, port in enumerate(producer_ports):
        argv = service_argv(producer_svc)
        penv = {**lmpipe_env(), **service_env(producer_svc)}
        procs.start(*argv[1:], *local, "--metrics-port", str(port), name=f"producer{i}", env=penv)

    config = tmp_path / "prometheus.yml"
    config.write_text(
        render_prometheus.render(
            trainer=f"127.0.0.1:{trainer_port}",
            producers=[f"127.0.0.1:{p}" for p in producer_ports],
            scrape_interval="1s",
            rule_file=str(render_prometheus.RULES),
        )
    )
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        exprs = dashboard_exprs()
        failures: dict[str, str] = {}
        results: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(1)
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            for p in procs.procs:
                assert p.poll() is None, f"{p.args} exited:\n{procs.log(p)[-3000:]}"
            try:
                up = prom_query(prom_port, "up == 1")
            except (urllib.error.URLError, ConnectionError):
                continue  # Prometheus is still starting
            if len(up) < n + 1:
                continue
            failures, results = {}, {}
            for expr in exprs:
                res = results[expr] = prom_query(prom_port, expand(expr))
                values = [float(r["value"][1]) for r in res]
                if not res:
                    if not empty_allowed(expr):
                        failures[expr] = "no data"
                elif not all(math.isfinite(v) for v in values) and not nan_allowed(expr):
                    failures[expr] = f"non-finite values {values}"
            # enough scrapes: two logging intervals (the trainer publishes loss and grad norm at each)
            steps = prom_query(prom_port, "sum(lmpipe_trainer_steps_total)")
            if not failures and steps and float(steps[0]["value"][1]) >= 20:
                break
        else:
            pytest.fail(f"after 60 s, dashboard queries without data: {json.dumps(failures, indent=1)}")

        jobs = {r["metric"]["job"] for r in up}
        assert jobs == {"trainer", "producer"} and len(up) == n + 1, up

        def value(expr: str, **labels) -> float:
            rows = [r for r in results[expr] if all(r["metric"].get(k) == v for k, v in labels.items())]
            assert len(rows) == 1, (expr, results[expr])
            return float(rows[0]["value"][1])

        def find(*needles: str) -> str:
            (hit,) = {e for e in exprs if all(s in e for s in needles)}
            return hit

        assert value(find("sum(rate(lmpipe_trainer_tokens_total")) > 0, "the trainer trains"
        assert value(find("sum(rate(lmpipe_producer_tokens_total")) > 0, "the producers produce"
        assert 0 <= value(find("lmpipe_trainer_data_waiting_seconds_total")) <= 1
        assert value(find("max(lmpipe_trainer_producers_connected)")) == n, "every replica joined"
        assert value(find("lmpipe_producer_padding_tokens_total"), strategy="pack") > 0.99
        assert value(find("rate(lmpipe_trainer_cache_hits_total"), cache="causal_mask") > 0.5, (
            "packed rows on CPU hit the causal-mask cache"
        )
        assert value(find("max(lmpipe_trainer_global_step)")) > 0
        assert 0 <= value(find("time() - max(lmpipe_trainer_checkpoint_timestamp_seconds)")) < 60
        assert value(find("lmpipe_trainer_checkpoint_step")) % 5 == 0
        refusals = {r["metric"]["reason"]: float(r["value"][1]) for r in results[find("handshake_refusals")]}
        assert refusals == dict.fromkeys(REFUSAL_REASONS, 0.0), refusals
        assert len({r["metric"]["instance"] for r in results[find("lmpipe_producer_epoch")]}) == n, (
            "the replicas' progress, one series per replica"
        )
        assert all(float(r["value"][1]) == 1 for r in results["up"])
        # the Topology row: one rank, reporting, with every shard; a fresh start resumed from nothing (NaN)
        assert value("max(lmpipe_trainer_world_size)") == 1 == value("count(lmpipe_trainer_world_size)")
        assert value("min(lmpipe_trainer_rank_shards)") == value("sum(lmpipe_trainer_rank_shards)") > 0
        assert math.isnan(value("max(lmpipe_trainer_resumed_step)"))
        # the alert rules are loaded and evaluate without error against the live metrics
        url = f"http://127.0.0.1:{prom_port}/api/v1/rules"
        with urllib.request.urlopen(url, timeout=10) as r:
            groups = json.loads(r.read())["data"]["groups"]
        evaluated = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        assert len(evaluated) == 8 and set(evaluated.values()) == {"ok"}, evaluated
        firing = [a for a in prom_query(prom_port, "ALERTS") if a["metric"]["alertstate"] == "firing"]
        assert not firing, f"a healthy run fires no alert: {firing}"
        assert 0 < value("lmpipe_trainer_loss") < math.log(load_tokenizer().vocab_size) + 1
        assert value("lmpipe_trainer_grad_norm") > 0 and value("lmpipe_trainer_learning_rate") > 0
        assert value("lmpipe_trainer_loss_scale") == 1, "fp32: not scaling"
        p50 = value(find("histogram_quantile(0.5, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket"))
        p99 = value(find("histogram_quantile(0.99, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket"))
        assert 0 < p50 <= p99
    finally:
        prom.kill()
        prom.wait()
        log.close()


def test_promtool_accepts_the_shipped_and_the_test_config(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no `promtool`: install Debian's prometheus package (.ci/run does)")
    local = tmp_path / "local.yml"
    local.write_text(
        render_prometheus.render(
            trainer="127.0.0.1:9400",
            producers=["127.0.0.1:9401"],
            scrape_interval="1s",
            rule_file=str(render_prometheus.RULES),
        )
    )
    for path in (render_prometheus.SHIPPED, local):
        r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(render_prometheus.render().replace("type: A", "type: BOGUS"))
    r = subprocess.run([promtool, "check", "config", str(broken)], capture_output=True, text=True)
    assert r.returncode != 0, "promtool is checking for real"
