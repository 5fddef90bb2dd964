"""`lmpipe plot`: a real run's --summary-json drawn as a PNG (loss, tokens/s, data wait); bad input is one
line and exit 2."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from tests.helpers import free_port_pair, lmpipe_env

pytest.importorskip("matplotlib", reason="lmpipe plot needs the plot extra (the dev extra has it)")


def lmpipe(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmpipe", *args], cwd=cwd, env=lmpipe_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "a PNG file"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_a_run_summary_becomes_a_picture(tmp_path):
    summary = tmp_path / "summary.json"
    r = lmpipe("run", "--steps", "20", "--log-every", "5", "--summary-json", str(summary), "--port",
               str(free_port_pair()), "--metrics-port", "-1", "--threads", "1", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    history = json.loads(summary.read_text())["history"]
    assert [h["step"] for h in history] == [5, 10, 15, 20], "one row per logging interval"
    assert all(h["tokens_per_second"] > 0 and 0 <= h["data_wait"] <= 1 and h["loss"] > 0 for h in history)
    assert history[-1]["elapsed"] > history[0]["elapsed"] > 0

    r = lmpipe("plot", str(summary), "--out", "run.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote run.png: 4 logging intervals of {summary}"
    assert png_size(tmp_path / "run.png") == (1200, 800), "12 x 8 inches at 100 dpi"


def test_plot_refuses_what_it_cannot_draw_in_one_line(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "old.json").write_text(json.dumps({"steps": 3, "losses": [1.0]}))
    for args, says in (
        (["missing.json"], "missing.json: no such file (write one with --summary-json)"),
        (["broken.json"], "broken.json: not a summary written by --summary-json"),
        (["old.json"], "old.json: no per-interval history"),
    ):
        r = lmpipe("plot", *args, "--out", "x.png", cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
        assert not (tmp_path / "x.png").exists()


def test_plot_refuses_an_out_that_is_not_a_picture_file(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"history": [{"step": 5, "elapsed": 1.0, "loss": 2.0,
                                                              "tokens_per_second": 10.0, "data_wait": 0.0}]}))  # fmt: skip
    (tmp_path / "adir").mkdir()
    for out, says in (
        ("adir", "--out adir is a directory"),
        ("noext", "--out noext: name the picture's file"),
    ):
        r = lmpipe("plot", "s.json", "--out", out, cwd=tmp_path)  # it wrote adir.png and said "wrote adir"
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "s.json"]


@pytest.mark.slow
def test_the_history_reaches_the_last_step_of_a_run_that_ran_out_of_data(tmp_path):
    summary = tmp_path / "summary.json"
    r = lmpipe("run", "--builtin-docs", "300", "--epochs", "1", "--steps", "0", "--log-every", "7",
               "--summary-json", str(summary), "--port", str(free_port_pair()), "--metrics-port", "-1",
               "--threads", "1", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["steps"] % 7, out["steps"]  # a partial last interval
    assert out["history"][-1]["step"] == out["steps"], "the plot stopped at the last full interval before"
    assert out["history"][-1]["loss"] == pytest.approx(out["last_loss"])
