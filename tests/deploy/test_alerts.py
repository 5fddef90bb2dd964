"""The alert rules (deploy/prometheus/lmpipe.rules.yml): accepted by promtool, unit-tested with
`promtool test rules` (each alert fires when it must and stays quiet when it must not), built on metrics
that shared/metrics.py exports, and loaded by the compose Prometheus."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.compose import load_compose
from tests.deploy.exported import sample_names
from tests.deploy.shipped import COMPOSE, render_prometheus
from tests.helpers import REPO

RULES = render_prometheus.RULES
RULE_TESTS = RULES.with_name("lmpipe.rules.test.yml")
ALERTS = {
    "TrainerDown", "TrainerNoProgress", "DataWaitHigh", "ProducerDown", "ProducersMissing",
    "LossScaleOverflowStorm", "StaleCheckpoint",
}  # fmt: skip


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("no `promtool`: install Debian's prometheus package (.ci/run does)")
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    r = run("check", "rules", RULES.name, cwd=RULES.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert {r["alert"] for r in rules()} == ALERTS == tested, "every alert has unit tests"


@pytest.mark.parametrize(
    "alert, old, new",
    [
        ("DataWaitHigh", "> 0.05", "> 0.5"),  # a bound ten times too loose
        ("TrainerNoProgress", "lmpipe_trainer_global_step", "lmpipe_trainer_steps_total"),  # resets on resume
        ("StaleCheckpoint", "for: 5m", "for: 0m"),
    ],
)
def test_the_unit_tests_catch_a_broken_rule(tmp_path, alert, old, new):
    text = RULES.read_text()
    start = text.index(f"- alert: {alert}")
    end = text.find("- alert:", start + 1)
    end = len(text) if end < 0 else end
    assert old in text[start:end]
    (tmp_path / RULES.name).write_text(text[:start] + text[start:end].replace(old, new) + text[end:])
    tests = RULE_TESTS.read_text()
    if alert == "TrainerNoProgress":  # the resumed trainer's case needs its per-process counter
        tests = tests.replace(
            '        values: "100+5x30"',
            '        values: "100+5x30"\n      - series: \'lmpipe_trainer_steps_total{job="trainer", '
            'instance="trainer:9400"}\'\n        values: "0x30"',
        )
    (tmp_path / RULE_TESTS.name).write_text(tests)
    r = run("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0 and alert in r.stdout + r.stderr, r.stdout + r.stderr


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
