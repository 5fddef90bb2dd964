"""Grafana: the provisioning points at the compose Prometheus and the dashboard, whose every query uses
metrics and labels that shared/metrics.py exports."""

from __future__ import annotations

import json
import re

import yaml

from tests.deploy.compose import load_compose, service_env
from tests.deploy.dashboard import dashboard, dashboard_exprs, dashboard_panels
from tests.deploy.exported import sample_names
from tests.deploy.shipped import COMPOSE, DASHBOARD, DASHBOARD_PROVIDERS, DATASOURCES, DEPLOY
from tests.helpers import REPO


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


def test_every_metric_the_dashboard_uses_is_exported():
    known = sample_names()
    assert "lmpipe_trainer_step_seconds_bucket" in known and "lmpipe_producer_tokens_total" in known
    used = set()
    for expr in dashboard_exprs():
        metrics = set(re.findall(r"\blmpipe_[a-z0-9_]+", expr))
        if expr == "up":  # Prometheus's own series, one per scrape target
            continue
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
    assert "up" in dashboard_exprs(), "a panel shows every scrape target's up"
    for needle in (
        "rate(lmpipe_producer_tokens_total",
        "rate(lmpipe_trainer_tokens_total",
        # counted while the trainer waits: 100% for a starved one (a ratio over step time is 0/0 there)
        "sum(rate(lmpipe_trainer_data_waiting_seconds_total[$__rate_interval]))",
        "histogram_quantile(0.5, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(lmpipe_trainer_step_seconds_bucket",
        "sum by (strategy) (rate(lmpipe_producer_padding_tokens_total",
        "lmpipe_trainer_loss",
        "lmpipe_trainer_learning_rate",
        "lmpipe_trainer_loss_scale",
        "rate(lmpipe_trainer_scaler_overflows_total",
        "rate(lmpipe_trainer_skipped_steps_total",
        # a rate-based ratio: what the cache does now, not since the trainer started
        "sum by (cache) (rate(lmpipe_trainer_cache_hits_total[$__rate_interval])) / (sum by (cache) (rate(lmpipe_trainer_cache_hits_total[$__rate_interval])) + sum by (cache) (rate(lmpipe_trainer_cache_misses_total[$__rate_interval])))",
        "sum by (reason) (rate(lmpipe_trainer_batches_rejected_total",
        "sum by (reason) (rate(lmpipe_trainer_stale_batches_total",
        "lmpipe_trainer_producers_connected",
        'rate(lmpipe_producer_send_blocked_seconds_total{instance=~"$producer"}',
        'rate(lmpipe_producer_storage_wait_seconds_total{instance=~"$producer"}',
        "sum by (kind) (lmpipe_trainer_gpu_memory_bytes)",
        "lmpipe_trainer_mfu_ratio",
        "max(lmpipe_trainer_global_step)",  # survives resume, unlike steps_total
        "time() - max(lmpipe_trainer_checkpoint_timestamp_seconds)",
        "sum(lmpipe_trainer_checkpoint_seconds_sum) / sum(lmpipe_trainer_checkpoint_seconds_count)",
        "sum by (reason) (rate(lmpipe_trainer_handshake_refusals_total",
        # producers serve shards that move between them: per replica (instance) its least advanced shard's
        # epoch; positions per shard, of the least and the most advanced shard
        'min by (instance) (lmpipe_producer_epoch{instance=~"$producer"})',
        'min(lmpipe_producer_cursor_position{instance=~"$producer"})',
        'max(lmpipe_producer_cursor_position{instance=~"$producer"})',
        'sum by (instance) (rate(lmpipe_producer_batches_sent_total{instance=~"$producer"}',
        "max by (stat) (lmpipe_trainer_shards_per_producer)",
        "sum(increase(lmpipe_trainer_producer_joins_total",
        "sum by (reason) (increase(lmpipe_trainer_producer_leaves_total",
    ):
        assert needle in exprs, needle
    titles = [p["title"] for p in dashboard_panels()]
    assert any("add producers" in t and "data wait" in t.lower() for t in titles), titles


def test_the_per_producer_panels_follow_the_producer_variable():
    """A job with many producers: every per-replica query is filtered by the `producer` variable (all by
    default), and every variable a query uses is defined."""
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    prod = variables["producer"]
    assert prod["multi"] and prod["includeAll"] and prod["allValue"] == ".*"
    assert "label_values(lmpipe_producer_" in prod["definition"] and ", instance)" in prod["definition"]
    per_replica = [e for e in dashboard_exprs() if "by (instance)" in e and "lmpipe_producer_" in e]
    assert len(per_replica) >= 5
    for expr in per_replica:
        for selector in re.findall(r"lmpipe_producer_[a-z_]+(\{[^}]*\})?", expr):
            assert selector == '{instance=~"$producer"}', expr
    for expr in dashboard_exprs():
        for var in re.findall(r"\$(\w+)", expr):
            assert var.startswith("__") or var in variables, f"${var} in {expr} is not a dashboard variable"


def test_the_checkpoint_step_is_not_drawn_in_seconds():
    (panel,) = [p for p in dashboard_panels() if "max(lmpipe_trainer_checkpoint_step)" in str(p["targets"])]
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"  # the age and the write time
    legend = next(t["legendFormat"] for t in panel["targets"] if "checkpoint_step" in t["expr"])
    (override,) = [o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == legend]
    assert {"id": "unit", "value": "none"} in override["properties"]
