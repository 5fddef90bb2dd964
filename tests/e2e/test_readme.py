"""The README, followed as written: every `lmpipe` command in its bash blocks parses (flags, choices,
values, settings checks); the quick start's first line runs the default job; the "Using it" block runs
end to end, on a slice of WikiText-2 and with short step counts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, WIKITEXT, free_port_pair, lmpipe_env
from tests.readme_blocks import bash_blocks, lmpipe_commands, section

README = REPO / "README.md"
WT2 = WIKITEXT  # the README's WT2: where this project's machines hold WikiText-2 (valid and test)


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**lmpipe_env(), "LMPIPE_RUNTIME_DIR": str(cwd / "run")}  # sockets apart from other tests
    r = subprocess.run(
        [sys.executable, "-m", "lmpipe", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, (
        f"lmpipe {shlex.join(argv)} exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    )
    return r


@pytest.mark.slow
def test_the_first_command_runs_the_default_job(tmp_path):
    (setup, _tests) = bash_blocks(README.read_text())[0]
    (argv,) = lmpipe_commands(setup)
    r = _run([*argv, "--metrics-port", "-1"], tmp_path, timeout=600)  # no flag of its own: the defaults
    assert "summary: 300 steps" in r.stderr + r.stdout and "(step limit)" in r.stderr + r.stdout


@pytest.mark.slow
def test_the_using_it_block_runs_on_a_slice_of_wikitext(tmp_path):
    if not (WT2 / "valid.txt").exists():
        pytest.skip(f"no WikiText-2 at {WT2}")
    # WT2 as the README describes it: train, valid and test, here slices of the validation split
    wt2 = tmp_path / "wt2"
    wt2.mkdir()
    articles = re.split(r"(?m)^(?= = [^=].* = $)", (WT2 / "valid.txt").read_text())
    for name, part in (("train", articles[1:25]), ("valid", articles[25:30]), ("test", articles[30:35])):
        (wt2 / f"{name}.txt").write_text("".join(part))
    using = bash_blocks(section(README.read_text(), "Using it"))[0]
    steps = iter([3, 2, 4])  # for the three runs: 500, 300 (the default) and 600 steps in the README
    ran = []
    for line in using:
        for argv in lmpipe_commands(line.replace("$WT2", str(wt2))):
            if argv[0] in ("keys", "train", "produce"):
                continue  # several hosts: test_multihost.py runs them
            if argv[0] == "run":
                # short: the last flag wins; the tiny model for the small one (checkpoints must agree)
                argv = [*argv, "--steps", str(next(steps)), "--model", "tiny", "--port", str(free_port_pair()),
                        "--metrics-port", "-1", "--threads", "1"]  # fmt: skip
            r = _run(argv, tmp_path, timeout=300)
            ran.append((argv[0], r.stdout + r.stderr))
    assert [c for c, _ in ran] == ["run", "tokenizer", "prepare", "run", "run", "export"]
    assert "summary: 2 steps (steps 3-4: resumed at 2)" in ran[4][1] and "resumed from" in ran[4][1], (
        "the second small run resumes"
    )
    assert (tmp_path / "model.safetensors").stat().st_size > 0
