"""The alert rules (deploy/prometheus/lmpipe.rules.yml): accepted by promtool, unit-tested with
`promtool test rules` (each alert fires when it must and stays quiet when it must not), built on metrics
that shared/metrics.py exports, and loaded by the compose Prometheus."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.deploy.compose import load_compose
from tests.deploy.exported import sample_names
from tests.deploy.shipped import COMPOSE, render_prometheus
from tests.helpers import REPO

RULES = render_prometheus.RULES


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_metric_and_label_the_rules_use_is_exported():
    known = sample_names()
    for rule in rules():
        expr = rule["expr"]
        metrics = set(re.findall(r"\blmpipe_[a-z0-9_]+", expr))
        assert metrics or expr.startswith("up{"), expr
        assert not metrics - set(known), f"{rule['alert']}: not in shared/metrics.py: {metrics - set(known)}"
        labels = set().union(*(known[m] for m in metrics)) | {"instance", "job"}
        for clause in re.findall(r"\bby \(([^)]*)\)", expr):
            assert {s.strip() for s in clause.split(",")} <= labels, expr
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_compose_prometheus_loads_the_rules():
    cfg = yaml.safe_load(render_prometheus.SHIPPED.read_text())
    assert cfg["rule_files"] == [RULES.name], "relative to the config file"
    volumes = load_compose(COMPOSE)["services"]["prometheus"]["volumes"]
    mounts = {target: source for source, target, *_ in (v.split(":") for v in volumes)}
    config = next(t for t, src in mounts.items() if (REPO / src).resolve() == render_prometheus.SHIPPED)
    rules_in_container = str(Path(config).parent / RULES.name)
    assert (REPO / mounts[rules_in_container]).resolve() == RULES, "mounted beside the config"
