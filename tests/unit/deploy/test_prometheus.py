"""A real Prometheus (Debian's package) scraping the compose services' own `lmpipe train` / `lmpipe produce`
commands, run here as local processes, through a config rendered from the template of the shipped one; then
every PromQL expression of the Grafana dashboard must return data. And the shipped config: the template's
rendering for compose, accepted by promtool."""

from __future__ import annotations

import yaml

from tests.deploy.shipped import render_prometheus


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
