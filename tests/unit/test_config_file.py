"""`--config FILE`: a TOML file equal to the flags, for every command. Precedence: flags, then LMPIPE_
variables, then the file, then the defaults; an unknown key or a bad value is one line naming the file and
the key, exit 2 (the real command line, in this process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmpipe import cli
from lmpipe.consumer.config import TrainConfig
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import from_args


def _parse(monkeypatch, *argv: str, env: dict[str, str] | None = None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ns = cli.build_parser().parse_args(list(argv))
    return from_args(ns, PipelineConfig), from_args(ns, TrainConfig)


def test_precedence_flags_then_variables_then_file_then_defaults(monkeypatch, tmp_path: Path):
    f = tmp_path / "run.toml"
    f.write_text(
        'steps = 7\nseq_len = 64\nbatch_size = 4\nlr = 1\ndata = ["a.txt", "b c.txt"]\ncompile = true\n'
    )
    cfg, tcfg = _parse(monkeypatch, "run", "--config", str(f), "--steps", "3", env={"LMPIPE_SEQ_LEN": "96"})
    assert tcfg.steps == 3  # the flag
    assert cfg.seq_len == 96  # the variable
    assert cfg.batch_size == 4 and tcfg.lr == 1.0 and tcfg.compile  # the file (an integer for a float)
    assert cfg.data == ["a.txt", "b c.txt"]
    assert tcfg.warmup == 20  # the default
    # before the command, as a global option, and from the environment
    cfg2, _ = _parse(monkeypatch, "--config", str(f), "produce")
    assert cfg2.batch_size == 4
    cfg3, _ = _parse(monkeypatch, "produce", env={"LMPIPE_CONFIG": str(f), "LMPIPE_SEQ_LEN": "32"})
    assert cfg3.batch_size == 4 and cfg3.seq_len == 32


def test_two_seeds_have_two_keys(monkeypatch, tmp_path: Path):
    f = tmp_path / "run.toml"
    f.write_text("seed = 3\ntrain_seed = 5\n")
    cfg, tcfg = _parse(monkeypatch, "run", "--config", str(f))
    assert (cfg.seed, tcfg.seed) == (3, 5)


@pytest.mark.parametrize(
    "text, said",
    [
        ("stpes = 7\n", "stpes: unknown key (did you mean steps?)"),
        ('steps = "x"\n', "steps: 'x' is not an integer"),
        ("steps = -1\n", "steps: -1 must be >= 0"),
        ('strategy = "zip"\n', "strategy: 'zip': choose one of"),
        ("compile = 1\n", "compile: 1 is not true or false"),
        ("data = 3\n", "data: must be a list"),
        ("[training]\nsteps = 3\n", "training: unknown key"),
        ("steps = \n", "not a TOML file"),
        ('config = "other.toml"\n', "config: a config file cannot name another"),
    ],
)
def test_a_bad_file_is_one_line_naming_file_and_key(lmpipe_cli, tmp_path: Path, text: str, said: str):
    f = tmp_path / "run.toml"
    f.write_text(text)
    r = lmpipe_cli("run", "--config", str(f), "--dry-run")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(f) in lines[0] and said in lines[0], r.stderr


def test_missing_file_and_cross_checks_name_the_file(lmpipe_cli, tmp_path: Path):
    r = lmpipe_cli("train", "--config", str(tmp_path / "none.toml"))
    assert r.returncode == 2 and "--config" in r.stderr and "no such file" in r.stderr
    f = tmp_path / "run.toml"
    f.write_text("slots = 1\naccum = 2\n")
    r = lmpipe_cli("run", "--config", str(f), "--dry-run")
    assert r.returncode == 2 and f"{f}: slots=1 is fewer than {f}: accum=2" in r.stderr
    r = lmpipe_cli("run", "--config", str(f), "--dry-run", "--accum", "1")  # a flag wins over the file
    assert r.returncode == 0, r.stderr
