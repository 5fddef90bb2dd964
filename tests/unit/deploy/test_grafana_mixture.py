"""The dashboard shows a mixture: per source, the realized token share against the target, and epochs."""

from __future__ import annotations

from tests.deploy.dashboard import dashboard_panels


def test_a_panel_shows_each_sources_realized_and_target_share_and_epoch():
    (panel,) = [p for p in dashboard_panels() if p["title"].startswith("Mixture")]
    exprs = "\n".join(t["expr"] for t in panel["targets"])
    for needle in (
        "sum by (source) (rate(lmpipe_trainer_source_tokens_total[$__rate_interval]))",
        "max by (source) (lmpipe_trainer_source_target_share)",
        "max by (source) (lmpipe_trainer_source_epoch)",
    ):
        assert needle in exprs, needle
