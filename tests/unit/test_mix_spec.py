"""Mixtures as settings: `--mix NAME=SOURCE:WEIGHT ...`, LMPIPE_MIX and `--mix-file` (TOML) give the same
Mix; bad input is one line naming what is wrong; the fingerprint names the sources, never the weights."""

from __future__ import annotations

import os

import pytest

from lmpipe.cli import build_parser
from lmpipe.shared.config import PipelineConfig, fingerprint, pipeline_argv
from lmpipe.shared.mix import Mix, Source, load_mix_file, parse_mix, shard_source, source_seed
from lmpipe.shared.settings import SettingsError, from_args

FILE = """
[sources.web]
data = ["data/web/", "more/web.jsonl"]
weight = 0.7
[sources.math]
data = "math.jsonl.zst"
weight = 0.1
epochs = 0
[sources.code]
data = ["s3://b/code/*.parquet"]
weight = 0.2
epochs = 3
[[schedule]]
step = 0
weights = { web = 0.7, math = 0.1, code = 0.2 }
[[schedule]]
step = 1000
weights = { web = 0.5, math = 0.25, code = 0.25 }
"""


@pytest.fixture
def clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
        monkeypatch.delenv(k)
    return monkeypatch.setenv


def test_items_split_at_the_first_equals_and_the_last_colon():
    mix = parse_mix(["web=data/web/:0.7", "code=s3://b/code/*.parquet:2", "x-1=a=b.txt:1e-3"], epochs=2)
    assert mix.sources == (
        Source("web", ("data/web/",), 0.7, 2),
        Source("code", ("s3://b/code/*.parquet",), 2.0, 2),
        Source("x-1", ("a=b.txt",), 0.001, 2),
    )
    assert mix.names() == ("web", "code", "x-1") and mix.schedule == ()
    assert mix.weights_at(123) == pytest.approx((0.7 / 2.701, 2 / 2.701, 0.001 / 2.701))


@pytest.mark.parametrize(
    "items, says",
    [
        ([], "at least one source"),
        (["web=data/web/"], "NAME=SOURCE:WEIGHT"),
        (["data/web/:0.5"], "NAME=SOURCE:WEIGHT"),
        (["web=data/web/:0"], "must be a finite number > 0"),
        (["web=data/web/:-1"], "must be a finite number > 0"),
        (["web=data/web/:nan"], "must be a finite number > 0"),
        (["web=data/web/:inf"], "must be a finite number > 0"),
        (["web=s3://b/x"], "is not a number"),
        (["web=:1"], "names no data"),
        (["Web=a.txt:1"], "source name 'Web'"),
        (["w.b=a.txt:1"], "source name 'w.b'"),
        ([f"{'a' * 33}=a.txt:1"], "1-32 characters"),
        (["web=a.txt:1", "web=b.txt:2"], "'web' is given twice"),
    ],
)
def test_bad_items_are_one_line(items, says):
    with pytest.raises(ValueError, match=says) as exc:
        parse_mix(items)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("--mix")


def test_the_file_gives_sources_in_order_with_epochs_and_a_schedule(tmp_path):
    f = tmp_path / "mix.toml"
    f.write_text(FILE)
    mix = load_mix_file(str(f), epochs=5)
    assert mix.sources == (
        Source("web", ("data/web/", "more/web.jsonl"), 0.7, 5),  # the run's --epochs
        Source("math", ("math.jsonl.zst",), 0.1, 0),
        Source("code", ("s3://b/code/*.parquet",), 0.2, 3),
    )
    assert mix.weights_at(0) == pytest.approx((0.7, 0.1, 0.2))
    assert mix.weights_at(500) == pytest.approx((0.6, 0.175, 0.225))  # piecewise-linear
    assert mix.weights_at(1000) == mix.weights_at(10**9) == pytest.approx((0.5, 0.25, 0.25))  # flat past it
    assert mix.fingerprint() == "web:epochs=5;math:epochs=0;code:epochs=3"


def test_a_schedule_that_starts_late_is_flat_before_it(tmp_path):
    f = tmp_path / "mix.toml"
    f.write_text(
        "[sources.a]\ndata='a'\nweight=1\n[sources.b]\ndata='b'\nweight=1\n"
        "[[schedule]]\nstep=10\nweights={a=3, b=1}\n[[schedule]]\nstep=20\nweights={a=1, b=3}\n"
    )
    mix = load_mix_file(str(f))
    assert mix.weights_at(0) == mix.weights_at(10) == pytest.approx((0.75, 0.25))
    assert mix.weights_at(15) == pytest.approx((0.5, 0.5))


@pytest.mark.parametrize(
    "text, says",
    [
        ("[sources.a]\ndata='a'\nweight=1\n[[schedule]]\nstep=5\nweights={a=1}\n"
         "[[schedule]]\nstep=5\nweights={a=2}\n", "step 5 follows step 5: steps must be in ascending order"),
        ("[sources.a]\ndata='a'\nweight=1\n[[schedule]]\nstep=9\nweights={a=1}\n"
         "[[schedule]]\nstep=3\nweights={a=2}\n", "ascending order"),
        ("[sources.a]\ndata='a'\nweight=1\n[[schedule]]\nstep=0\nweights={a=1, b=2}\n", "unknown source 'b'"),
        ("[sources.a]\ndata='a'\nweight=1\n[sources.b]\ndata='b'\nweight=1\n"
         "[[schedule]]\nstep=0\nweights={a=1}\n", "lacks a weight for 'b'"),
        ("[sources.a]\ndata='a'\nweight=1\n[[schedule]]\nstep=0\nweights={a=0}\n", "> 0"),
        ("[sources.a]\ndata='a'\nweight='x'\n", "the weight 'x' is not a number"),
        ("[sources.a]\ndata='a'\nweight=true\n", "is not a number"),
        ("[sources.a]\ndata='a'\nweight=-2\n", "> 0"),
        ("[sources.a]\ndata='a'\n", "lacks a weight"),
        ("[sources.a]\nweight=1\n", "data must be a path or a list"),
        ("[sources.a]\ndata=[]\nweight=1\n", "data must be a path or a list"),
        ("[sources.a]\ndata='a'\nweight=1\nepochs=-1\n", "epochs -1 must be an integer >= 0"),
        ("[sources.a]\ndata='a'\nweight=1\nweigth=2\n", "unknown key(s) weigth"),
        ("[sources.A]\ndata='a'\nweight=1\n", "source name 'A'"),
        ("[source.a]\ndata='a'\nweight=1\n", "unknown key(s) source"),
        ("", "no sources"),
        ("[sources.a\n", "not a valid TOML file"),
    ],
)  # fmt: skip
def test_bad_files_are_one_line_naming_the_file(tmp_path, text, says):
    f = tmp_path / "mix.toml"
    f.write_text(text)
    with pytest.raises(ValueError) as exc:
        load_mix_file(str(f))
    assert says in str(exc.value) and str(exc.value).startswith(f"--mix-file {f}: ")
    assert "\n" not in str(exc.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--mix-file .*nope.toml: No such file"):
        load_mix_file(str(tmp_path / "nope.toml"))


def test_shards_are_numbered_source_by_source():
    assert [shard_source(s, 4) for s in (0, 3, 4, 11)] == [(0, 0), (0, 3), (1, 0), (2, 3)]
    with pytest.raises(ValueError):
        shard_source(1, 0)


def test_a_source_seed_depends_on_the_run_seed_and_its_name_only():
    assert source_seed(0, "web") == source_seed(0, "web") != source_seed(1, "web") != source_seed(0, "code")
    assert 0 <= source_seed(2**62, "x") < 2**63


def test_the_settings_travel_by_flag_variable_and_argv(clean_env, tmp_path):
    ns = build_parser().parse_args(["run", "--mix", "web=a.txt:0.7", "code=s3://b/c/*.parquet:0.3"])
    cfg = from_args(ns, PipelineConfig)
    assert cfg.mix == ["web=a.txt:0.7", "code=s3://b/c/*.parquet:0.3"]
    mix = cfg.mixture()
    assert isinstance(mix, Mix) and mix.names() == ("web", "code")
    # how `lmpipe run` starts its producers: the same settings, whatever the environment says
    again = from_args(build_parser().parse_args(["produce", *pipeline_argv(cfg)]), PipelineConfig)
    assert again == cfg
    clean_env("LMPIPE_MIX", "web=a.txt:0.7 'code=my dir/c.jsonl:0.3'")
    cfg = from_args(build_parser().parse_args(["run"]), PipelineConfig)
    assert cfg.mixture() == parse_mix(["web=a.txt:0.7", "code=my dir/c.jsonl:0.3"])
    f = tmp_path / "m.toml"
    f.write_text(FILE)
    clean_env("LMPIPE_MIX", "")
    cfg = from_args(build_parser().parse_args(["run", "--mix-file", str(f), "--epochs", "2"]), PipelineConfig)
    assert cfg.mixture() == load_mix_file(str(f), epochs=2)
    assert from_args(build_parser().parse_args(["produce", *pipeline_argv(cfg)]), PipelineConfig) == cfg
    assert PipelineConfig().mixture() is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--mix", "web=a.txt:1", "--data", "b.txt"], "--mix and --data b.txt exclude each other"),
        (["--mix", "web=a.txt:1", "--mix-file", "{f}"], "--mix and --mix-file {f} exclude each other"),
        (["--mix-file", "{f}", "--data", "b.txt"], "--mix-file and --data b.txt exclude each other"),
        (["--mix", "web=a.txt:0"], "--mix web=a.txt:0: 'web=a.txt:0': the weight '0' must be"),
        (["--mix", "web=a.txt:1", "web=b.txt:1"], "'web' is given twice"),
        (["--mix-file", "{f}.missing"], "--mix-file {f}.missing: No such file"),
    ],
)
def test_bad_settings_are_one_line_naming_the_flag(clean_env, tmp_path, argv, says):
    f = tmp_path / "m.toml"
    f.write_text(FILE)
    argv = [a.replace("{f}", str(f)) for a in argv]
    with pytest.raises(SettingsError) as exc:
        from_args(build_parser().parse_args(["run", *argv]), PipelineConfig)
    assert says.replace("{f}", str(f)) in str(exc.value) and "\n" not in str(exc.value)


def test_bad_variable_names_the_variable(clean_env):
    clean_env("LMPIPE_MIX", "web=a.txt:zero")
    with pytest.raises(SettingsError, match=r"^LMPIPE_MIX=web=a.txt:zero: .*is not a number"):
        from_args(build_parser().parse_args(["run"]), PipelineConfig)
    clean_env("LMPIPE_MIX", "")
    clean_env("LMPIPE_DATA", "b.txt")  # a compose file's variable, and --mix given: the variable is named
    with pytest.raises(SettingsError, match=r"^--mix and LMPIPE_DATA=b.txt exclude each other"):
        from_args(build_parser().parse_args(["run", "--mix", "web=a.txt:1"]), PipelineConfig)


def test_the_fingerprint_names_sources_and_epochs_not_weights(tmp_path):
    plain = fingerprint(PipelineConfig(), "tok", 100, "data")
    assert "mix" not in plain and "mix_file" not in plain  # a run without a mixture: as before
    a = fingerprint(PipelineConfig(mix=["web=a.txt:0.7", "code=b.txt:0.3"]), "tok", 100)
    b = fingerprint(PipelineConfig(mix=["web=a.txt:0.1", "code=b.txt:5"]), "tok", 100)
    assert a == b and a["mix"] == "web:epochs=0;code:epochs=0"
    assert fingerprint(PipelineConfig(mix=["code=b.txt:0.3", "web=a.txt:0.7"]), "tok", 100) != a  # order
    assert fingerprint(PipelineConfig(mix=["web=a.txt:0.7", "code=b.txt:0.3"], epochs=2), "tok", 100) != a
    f = tmp_path / "m.toml"
    f.write_text(FILE.replace("weight = 0.7", "weight = 9"))
    g = tmp_path / "n.toml"
    g.write_text(FILE.split("[[schedule]]")[0])
    assert fingerprint(PipelineConfig(mix_file=str(f)), "t", 1) == fingerprint(
        PipelineConfig(mix_file=str(g)), "t", 1
    )
