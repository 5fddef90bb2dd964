"""The Grafana dashboard's panels and PromQL expressions, with Grafana's variables expanded."""

from __future__ import annotations

import json

from tests.deploy.shipped import DASHBOARD


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    """Every panel that queries: a row is a heading (no query), its panels are listed (collapsed into it or
    following it)."""
    out = []
    for p in dashboard()["panels"]:
        if p.get("type") != "row":
            out.append(p)
        out.extend(p.get("panels", []))  # panels collapsed into a row
    return out


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", []) if t.get("expr")]


# Dashboard series that are NaN on a CPU run, and why (metrics never fake a reading with 0). Every other
# query must return finite values against a live run.
NAN_ALLOWED: dict[str, str] = {
    "lmpipe_trainer_gpu_memory_bytes": "no GPU: no reading, and no reading is NaN rather than 0",
    "lmpipe_trainer_mfu_ratio": "MFU needs a known card's peak FLOP/s",
    "lmpipe_trainer_eval_loss": "no --eval-data in this run: no held-out loss yet",
    "lmpipe_trainer_resumed_": "a fresh start: resumed from no checkpoint",
}
# Dashboard series that do not exist in a run without the feature they show.
EMPTY_ALLOWED: dict[str, str] = {
    "lmpipe_trainer_source_": "the mixture panel: series per source only with --mix",
}


def nan_allowed(expr: str) -> bool:
    return any(m in expr for m in NAN_ALLOWED)


def empty_allowed(expr: str) -> bool:
    return any(m in expr for m in EMPTY_ALLOWED)


# Grafana's built-in variables, as Grafana would expand them for a 1 s scrape interval, wide enough that a
# window always holds several scrapes. A variable not listed here fails the test: add it deliberately.
# The dashboard's own `producer` variable at its default, All (its allValue).
GRAFANA_VARS = {"$__rate_interval": "10s", "$producer": ".*"}


def expand(expr: str, variables: dict[str, str] = GRAFANA_VARS) -> str:
    for var, val in variables.items():
        expr = expr.replace(var, val)
    assert "$" not in expr, f"dashboard variable this test does not expand: {expr}"
    return expr
