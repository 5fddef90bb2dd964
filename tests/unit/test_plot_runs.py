"""`lmpipe plot` of several runs on one figure: the learning rate, the held-out eval loss where a run has
one, each run's summary numbers in its legend entry, and tick labels as plain numbers (not `6×10^0`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lmpipe.plot import figure, read_runs

pytest.importorskip("matplotlib", reason="lmpipe plot needs the plot extra (the dev extra has it)")


def _summary(path: Path, scale: float, *, new: bool = True) -> Path:
    rows = [{"step": s, "elapsed": s / 10, "loss": scale * 9 / s ** 0.3, "tokens_per_second": 12_000.0 * scale,
             "data_wait": 0.01} for s in (10, 20, 30, 40)]  # fmt: skip
    summary = {"steps": 40, "last_loss": rows[-1]["loss"], "steady_tokens_per_second": 12_345.0,
               "data_wait_fraction": 0.02, "history": rows}  # fmt: skip
    if new:  # an lmpipe with the learning rate in its history and --eval-data's losses
        for r in rows:
            r["lr"] = 3e-3 * (1 - r["step"] / 50)
        summary["evals"] = [{"step": 20, "eval_loss": 4.5}, {"step": 40, "eval_loss": 4.25}]
        summary["eval_loss"] = 4.25
    path.write_text(json.dumps(summary))
    return path


def test_several_runs_on_one_figure_with_plain_tick_labels(tmp_path: Path):
    runs = read_runs([_summary(tmp_path / "a.json", 1.0), _summary(tmp_path / "b.json", 0.8, new=False)], [])
    fig = figure(runs)
    fig.canvas.draw()
    loss, lr, speed, wait = fig.axes[:4]
    assert len(loss.get_lines()) == 3  # two training curves, a's eval curve
    assert len(lr.get_lines()) == 1  # b's summary predates the learning rate in the history
    labels = [
        t.get_text() for ax in fig.axes[:4] for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels()
    ]
    assert labels and not [t for t in labels if "10^" in t or "times" in t or "$" in t or "×" in t], labels
    assert "12,000" in [t.get_text() for t in speed.get_yticklabels()]
    assert loss.get_yscale() == "log" and {"4", "5", "6"} <= set(labels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0] == "a: 40 steps, loss 2.976, eval 4.250, 12,345 tok/s steady, data wait 2.0%"
    assert "a: eval loss (held out)" in legend and legend[-1].startswith("b: 40 steps, loss 2.381, 12,345")


def test_plot_command_labels_runs_and_refuses_a_label_count_that_does_not_match(lmpipe_cli, tmp_path: Path):
    a, b = _summary(tmp_path / "a.json", 1.0), _summary(tmp_path / "b.json", 0.9)
    out = tmp_path / "runs.png"
    r = lmpipe_cli("plot", str(a), str(b), "--label", "baseline", "bucket", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}: 2 runs: baseline (4 intervals), bucket (4 intervals)"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1200, 800)
    bad = lmpipe_cli("plot", str(a), str(b), "--label", "one", "--out", str(tmp_path / "x.png"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--label: 1 label(s) for 2" in bad.stderr
    assert not (tmp_path / "x.png").exists()
