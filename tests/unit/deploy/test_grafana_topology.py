"""The dashboard's Topology row: the trainer's world size, each rank's shards and what a run resumed from,
aggregated over ranks so that it stays readable on a job with many; and a layout without overlaps."""

from __future__ import annotations

from tests.deploy.dashboard import dashboard, dashboard_panels

TOPOLOGY = (
    "lmpipe_trainer_world_size",
    "lmpipe_trainer_rank_shards",
    "lmpipe_trainer_resumed_step",
    "lmpipe_trainer_resumed_world_size",
)


def _topology_panels() -> list[dict]:
    top = dashboard()["panels"]
    (row,) = [p for p in top if p.get("type") == "row" and p["title"] == "Topology"]
    if row.get("collapsed"):
        return row["panels"]
    nxt = [
        p["gridPos"]["y"] for p in top if p.get("type") == "row" and p["gridPos"]["y"] > row["gridPos"]["y"]
    ]
    end = min(nxt, default=10**9)
    return [p for p in top if p.get("type") != "row" and row["gridPos"]["y"] < p["gridPos"]["y"] < end]


def test_the_topology_row_shows_every_topology_metric_aggregated_over_ranks():
    panels = _topology_panels()
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    for name in TOPOLOGY:
        assert any(name in e for e in exprs), f"no panel of the Topology row shows {name}"
    for e in exprs:  # one series per query whatever the number of ranks: min, max, sum or count over them
        assert e.split("(")[0] in ("min", "max", "sum", "count"), f"{e}: a series per rank"
        assert " by (" not in e, e
    assert "count(lmpipe_trainer_world_size)" in exprs, "how many ranks report, beside the world size"
    assert {"min(lmpipe_trainer_resumed_step)", "max(lmpipe_trainer_resumed_step)"} <= set(exprs), (
        "ranks that resumed from different steps show as two lines"
    )


def test_a_fresh_start_reads_as_such_not_as_nan():
    (resumed,) = [
        p for p in _topology_panels() if p["type"] == "stat" and "resumed_step" in str(p["targets"])
    ]
    mappings = resumed["fieldConfig"]["defaults"]["mappings"]
    assert {"type": "special", "options": {"match": "nan", "result": {"text": "fresh start"}}} in mappings


def test_no_two_panels_overlap():
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    assert len(dashboard_panels()) == len({p["id"] for p in dashboard_panels()})
