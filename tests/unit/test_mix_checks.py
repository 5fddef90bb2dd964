"""A mixture's data is checked before anything starts, each source on its own, and a mistake is one line
naming the source: `lmpipe run` and `lmpipe produce` alike (the real command line, `lmpipe.cli.main`, in
this process). A resume checks each source's files against the checkpoint's, and its sources' names."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from lmpipe import cli
from lmpipe.checks import check_corpus, check_resume_corpus, check_tokenizer
from lmpipe.consumer.config import TrainConfig
from lmpipe.producer.corpora import Corpora
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError
from tests.helpers import REPO


@pytest.fixture
def lmpipe(monkeypatch, capsys):
    """`lmpipe ARGS` in this process: (exit status, stderr)."""

    def run(*args: str) -> tuple[int, str]:
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        with monkeypatch.context() as m:
            for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
                m.delenv(k)
            m.chdir(REPO)
            capsys.readouterr()
            try:
                code = cli.main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                root.handlers[:], root.level = handlers, level
                for s, h in signals.items():
                    signal.signal(s, h)
        return code, capsys.readouterr().err

    return run


@pytest.fixture
def files(tmp_path):
    (tmp_path / "web.txt").write_text("A first web page.\n\nA second one.\n")
    (tmp_path / "math.jsonl").write_text(json.dumps({"text": "1 + 1 = 2"}) + "\n")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    return tmp_path


@pytest.mark.parametrize("cmd", ["run", "produce"])
@pytest.mark.parametrize(
    "source, says",
    [
        ("missing.txt", "--mix: source 'math': "),
        ("empty.txt", "--mix: source 'math': no documents in "),
    ],
)
def test_each_source_is_checked_and_named(lmpipe, files, port, cmd, source, says):
    code, err = lmpipe(
        cmd, "--port", str(port), "--runtime-dir", str(files / "run"),
        "--mix", f"web={files / 'web.txt'}:0.7", f"math={files / source}:0.3",
    )  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err


def test_a_mix_file_source_is_named_with_the_file(lmpipe, files, port):
    f = files / "mix.toml"
    f.write_text(f"[sources.web]\ndata = ['{files / 'web.txt'}']\nweight = 1\n"
                 f"[sources.code]\ndata = ['{files / 'nope'}/*.parquet']\nweight = 1\n")  # fmt: skip
    code, err = lmpipe("run", "--port", str(port), "--runtime-dir", str(files / "run"), "--mix-file", str(f))
    assert code == 2 and err.count("\n") == 1 and f"--mix-file {f}: source 'code': " in err, err


def test_the_settings_mistakes_are_one_line(lmpipe, files):
    code, err = lmpipe("run", "--mix", f"web={files / 'web.txt'}:0.7", "--data", str(files / "web.txt"))
    assert (
        code == 2 and err.count("\n") == 1 and "--mix and --data " in err and "exclude each other" in err
    ), err
    code, err = lmpipe("produce", "--mix", f"web={files / 'web.txt'}")
    assert code == 2 and err.count("\n") == 1 and "NAME=SOURCE:WEIGHT" in err, err


def _corpora(files, **sources: str) -> Corpora:
    cfg = PipelineConfig(mix=[f"{n}={files / f}:1" for n, f in sources.items()])
    return check_corpus(cfg, check_tokenizer(cfg))


def _checkpoint(tmp_path, corpora: Corpora):
    ck = tmp_path / "ck"
    ck.mkdir(exist_ok=True)
    header = {"format_version": 1, "data": corpora.fingerprint(), "data_content": corpora.content_digest()}
    (ck / "header.json").write_text(json.dumps(header))
    return TrainConfig(resume=str(ck))


def test_a_resume_checks_each_source_and_the_sources_names(files):
    ck = _checkpoint(files, _corpora(files, web="web.txt", math="math.jsonl"))
    check_resume_corpus(_corpora(files, web="web.txt", math="math.jsonl"), ck)  # the same: fine
    (files / "math.jsonl").write_text(json.dumps({"text": "1 + 1 = 2, and more"}) + "\n")
    with pytest.raises(SettingsError, match=r"trained on other data in source 'math' \(trained on, not in"):
        check_resume_corpus(_corpora(files, web="web.txt", math="math.jsonl"), ck)
    with pytest.raises(SettingsError, match="trained on the sources web, math, this run names math, web"):
        check_resume_corpus(_corpora(files, math="math.jsonl", web="web.txt"), ck)
    plain = PipelineConfig(data=[str(files / "web.txt")])
    with pytest.raises(SettingsError, match="was trained on a mixture \\(web, math\\)"):
        check_resume_corpus(check_corpus(plain, check_tokenizer(plain)), ck)


def test_a_resume_sees_one_source_rewritten_in_place(files):
    ck = _checkpoint(files, _corpora(files, web="web.txt", math="math.jsonl"))
    (files / "math.jsonl").write_text(json.dumps({"text": "2 + 2 = 4"}) + "\n")  # same size
    with pytest.raises(SettingsError, match="same names and sizes, but their contents changed"):
        check_resume_corpus(_corpora(files, web="web.txt", math="math.jsonl"), ck)


def test_the_producers_of_a_run_and_of_the_library_get_the_mixture(files):
    """`lmpipe run` forks its producers with its rank's settings (per_rank); the Loader spawns them with
    the settings as JSON (procs.spawn_producers): both carry the mixture whole."""
    from dataclasses import asdict

    from lmpipe.consumer.config import per_rank

    f = files / "mix.toml"
    f.write_text(f"[sources.web]\ndata = '{files / 'web.txt'}'\nweight = 2\nepochs = 1\n")
    for cfg in (PipelineConfig(mix=[f"web={files / 'web.txt'}:0.7"]), PipelineConfig(mix_file=str(f))):
        rank_cfg, _ = per_rank(cfg, TrainConfig(), 1, 2)
        assert rank_cfg.mixture() == cfg.mixture() and rank_cfg.rank == 1
        assert PipelineConfig(**json.loads(json.dumps(asdict(rank_cfg)))).mixture() == cfg.mixture()
