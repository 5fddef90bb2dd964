"""`--dry-run` of run, train and produce: the resolved settings with where each came from, what would
start, the checks a real start makes, and nothing started (the real command line, in this process)."""

from __future__ import annotations

import socket
from pathlib import Path


def _line(out: str, key: str) -> str:
    return next(
        line for line in out.splitlines() if line.startswith(f"{key} = ") or line == f"# {key} = none"
    )


def test_run_dry_run_says_settings_and_sources_and_starts_nothing(lmpipe_cli, tmp_path: Path, port: int):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "run.toml").write_text("warmup = 2\nlr = 0.01\n")
    r = lmpipe_cli(
        "run", "--dry-run", "--config", str(tmp_path / "run.toml"), "--steps", "5", "--device", "cpu",
        "--port", str(port), "--runtime-dir", str(tmp_path / "rt"), "--checkpoint-dir", str(ckpt),
        "--resume", "auto", env={"LMPIPE_SEQ_LEN": "64"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert _line(out, "steps").endswith("# --steps")
    assert _line(out, "seq_len").startswith("seq_len = 64") and _line(out, "seq_len").endswith(
        "# LMPIPE_SEQ_LEN"
    )
    assert _line(out, "warmup").endswith("run.toml: warmup") and _line(out, "lr").startswith("lr = 0.01")
    assert _line(out, "batch_size").endswith("# default")
    assert _line(out, "train_seed").endswith("# default")  # the trainer's seed, apart from the producers'
    assert "2 producer process(es) on the built-in corpus" in out
    assert "model tiny: 5" in out and "parameters" in out  # counted without building it on a device
    assert f"start fresh (--resume auto: no checkpoint in {ckpt} yet)" in out
    assert not ckpt.exists()  # not made, not locked
    with socket.socket() as s:  # nothing bound: the port is free
        s.bind(("127.0.0.1", port))


def test_dry_run_refuses_as_the_real_start_does(lmpipe_cli, port: int):
    args = ("run", "--producers", "9", "--shards", "4", "--port", str(port))
    real, dry = lmpipe_cli(*args), lmpipe_cli(*args, "--dry-run")
    assert real.returncode == dry.returncode == 2
    assert dry.stderr == real.stderr and len(dry.stderr.strip().splitlines()) == 1
    assert "--producers 9" in dry.stderr and dry.stdout == ""


def test_dry_run_output_is_a_config_file(lmpipe_cli, tmp_path: Path, port: int):
    """The settings block is TOML: fed back as --config, the run resolves to the same settings."""
    first = lmpipe_cli("train", "--dry-run", "--steps", "9", "--data", "README.md", "--port", str(port))
    assert first.returncode == 0, first.stderr
    (tmp_path / "same.toml").write_text(first.stdout)
    again = lmpipe_cli("train", "--dry-run", "--config", str(tmp_path / "same.toml"))
    assert again.returncode == 0, again.stderr

    def values(out: str) -> list[str]:
        return [
            line.split("  #")[0].strip()
            for line in out.splitlines()
            if " = " in line and "config" not in line
        ]

    assert values(again.stdout) == values(first.stdout)
    assert "no producers: they connect from elsewhere" in again.stdout


def test_produce_dry_run_needs_no_trainer(lmpipe_cli, port: int, tmp_path: Path):
    r = lmpipe_cli(
        "produce", "--dry-run", "--port", str(port), "--worker", "1", "--runtime-dir", str(tmp_path / "rt")
    )
    assert r.returncode == 0, r.stderr
    assert "producer 1, connecting to the trainer at ipc://" in r.stdout
    assert _line(r.stdout, "worker").endswith("# --worker")
    bad = lmpipe_cli("produce", "--dry-run", "--worker", "5", "--producers", "2")
    assert bad.returncode == 2 and "--worker 5 must be below --producers 2" in bad.stderr
