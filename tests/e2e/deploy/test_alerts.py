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

from tests.deploy.scrape import scrape, wait_for_scrape
from tests.deploy.shipped import render_prometheus
from tests.helpers import free_port_pair, free_ports, wait_until

RULES = render_prometheus.RULES
RULE_TESTS = RULES.with_name("lmpipe.rules.test.yml")
ALERTS = {
    "TrainerDown", "TrainerNoProgress", "DataWaitHigh", "ProducerDown", "ProducerLost", "ShardsUnserved",
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
    "alert, old, new, caught",
    [
        ("DataWaitHigh", "> 0.05", "> 0.5", ""),  # a bound ten times too loose
        # the rule before: a ratio over the step time, 0/0 (never firing) for a trainer starved of every batch
        (
            "DataWaitHigh",
            "sum by (job, instance) (rate(lmpipe_trainer_data_waiting_seconds_total[5m])) > 0.05",
            "sum by (job, instance) (rate(lmpipe_trainer_data_wait_seconds_sum[5m]))"
            " / sum by (job, instance) (rate(lmpipe_trainer_step_seconds_sum[5m])) > 0.05",
            "alertname: DataWaitHigh, time: 15m",
        ),
        # a scale-down's producers said bye: counting them too alerts on every deliberate scale-down
        ("ProducerLost", '{reason=~"closed|silent"}', "", "alertname: ProducerLost, time: 25m"),
        (
            "TrainerNoProgress",
            "lmpipe_trainer_global_step",
            "lmpipe_trainer_steps_total",
            "",
        ),  # resumes reset it
        ("StaleCheckpoint", "for: 5m", "for: 0m", ""),
        # the rule before elastic producers: fires on a deliberate scale-down with every shard served
        (
            "ShardsUnserved",
            "lmpipe_trainer_shards_unserved > 0",
            "lmpipe_trainer_producers_connected < lmpipe_trainer_producers_expected",
            "alertname: ShardsUnserved, time: 12m",
        ),
        # fires on the minute a cut-off producer's shards wait for its connection to close
        ("ShardsUnserved", "for: 2m", "for: 0m", "alertname: ShardsUnserved, time: 2m"),
    ],
)
def test_the_unit_tests_catch_a_broken_rule(tmp_path, alert, old, new, caught):
    """`caught`: the failure the unit tests must report (which case catches it), beyond the alert's name."""
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
    assert caught in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_shards_unserved_stays_0_through_a_scale_down_and_counts_the_shards_once_all_producers_left(procs):
    """What ShardsUnserved, DataWaitHigh and ProducerLost read, from a real trainer: every shard before a
    producer comes, and the starved trainer's wait counted;
    none while producers scale from 3 down to 1 (fewer than --producers: the rule before elastic producers
    fired here), each leaver counted as a bye; all open shards again once the last producer was killed,
    counted as a leave without one."""
    port, mport = free_port_pair(), free_ports(1)
    shards = 6
    common = ["--port", str(port), "--producers", "3", "--builtin-docs", "100000", "--seq-len", "64",
              "--batch-size", "4"]  # fmt: skip
    trainer = procs.start("train", *common, "--shards", str(shards), "--steps", "0", "--threads", "1",
                          "--metrics-port", str(mport), name="trainer")  # fmt: skip
    procs.wait_for(trainer, "listening on")

    def gauge(name: str) -> float:
        return scrape(mport).get(f"lmpipe_trainer_{name}")

    assert wait_for_scrape(mport).get("lmpipe_trainer_shards_unserved") == shards, "nothing served yet"
    # what DataWaitHigh reads: a trainer starved of every batch ends no step, yet counts its wait
    wait_until(lambda: gauge("data_waiting_seconds_total") >= 2, 60, "the starved trainer's wait counted")
    assert gauge("global_step") == 0
    producers = [procs.start("produce", *common, "--metrics-port", "-1", name=f"p{i}") for i in range(3)]
    wait_until(lambda: gauge("producers_connected") == 3, 60, "3 producers connected")
    assert gauge("shards_unserved") == 0
    for p in producers[1:]:  # what `docker compose up --scale producer=1` does to the others
        p.terminate()
        assert procs.wait(p, 30) == 0
    wait_until(lambda: gauge("producers_connected") == 1, 30, "1 producer left")
    assert gauge("producers_expected") == 3 and gauge("shards_unserved") == 0, "its shards were handed on"
    assert "holds shards" in procs.log(trainer) and "moved" in procs.log(trainer)

    def leaves() -> dict[str, float]:
        return scrape(mport).by_label("lmpipe_trainer_producer_leaves_total", "reason")

    # what ProducerLost reads: the scaled-down producers said bye (no alert); a killed one did not
    assert leaves() == {"bye": 2, "closed": 0, "silent": 0, "stopped": 0}
    producers[0].kill()
    procs.wait(producers[0], 30)
    wait_until(lambda: gauge("shards_unserved") == shards, 60, "every shard unserved")
    assert leaves() == {"bye": 2, "closed": 1, "silent": 0, "stopped": 0}
    assert trainer.poll() is None, procs.log(trainer)[-3000:]
