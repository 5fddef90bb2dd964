"""The README, followed as written: every `lmpipe` command in its bash blocks parses (flags, choices,
values, settings checks); the quick start's first line runs the default job; the "Using it" block runs
end to end, on a slice of WikiText-2 and with short step counts."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from lmpipe.cli import build_parser
from lmpipe.shared.settings import SettingsError, from_args
from tests.helpers import REPO, WIKITEXT
from tests.readme_blocks import bash_blocks, lmpipe_commands, section

README = REPO / "README.md"
ARCHITECTURE = REPO / "docs" / "architecture.md"
WT2 = WIKITEXT  # the README's WT2: where this project's machines hold WikiText-2 (valid and test)


def parse(argv: list[str]) -> None:
    """What `lmpipe` does with argv before any work: argparse, then every settings class and its checks."""
    ns = build_parser().parse_args(argv)
    for cls in ns.settings:
        from_args(ns, cls)


def test_the_architecture_page_names_every_module():
    """A newcomer finds each module of the package, subpackages included, in docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    missing = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "lmpipe").rglob("*.py"))
        if not path.name.startswith("__") and f"`{path.name}`" not in text
    ]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_quick_start_is_install_and_run_then_the_tests():
    text = README.read_text()
    first = bash_blocks(text)[0]
    assert len(first) == 2, first
    setup, tests = first
    assert setup.startswith("python3 -m venv .venv && .venv/bin/pip install ") and "-e '.[train]'" in setup
    assert "[dev]" not in setup, "the first line installs what training needs, no test or deploy tooling"
    assert setup.endswith("&& .venv/bin/lmpipe run"), "the first line runs the default job"
    assert "-e '.[dev]'" in tests and tests.endswith("&& .venv/bin/python -m pytest -q"), (
        "the second runs the tests"
    )
    cpu = re.search(r"No GPU\?.*?```bash\n(.*?)\n```", text, re.S)
    assert cpu and "--index-url https://download.pytorch.org/whl/cpu" in cpu[1], "the CPU index, spelled out"
    assert re.search(r"torch==([\d.]+)", cpu[1])[1] == re.search(r"torch==([\d.]+)", setup)[1]


def test_every_lmpipe_command_in_the_readme_parses(monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")})
    commands = [
        argv for block in bash_blocks(README.read_text()) for ln in block for argv in lmpipe_commands(ln)
    ]
    assert len(commands) >= 15, commands
    # what the README's own commands make (--out ...): a check may find it missing here, and only that
    made = {argv[i + 1] for argv in commands for i, a in enumerate(argv[:-1]) if a == "--out"}
    for argv in commands:
        argv = [a.replace("$WT2", str(WT2)) for a in argv]
        try:
            parse(argv)
        except SystemExit as exc:  # argparse: a usage mistake
            pytest.fail(f"lmpipe {shlex.join(argv)}: exit {exc.code}")
        except SettingsError as exc:
            missing = re.fullmatch(r"--[\w-]+ (\S+): no such (?:file|directory)", str(exc))
            assert missing and missing[1] in made, f"lmpipe {shlex.join(argv)}: {exc}"


def test_using_it_follows_wikitext_practice():
    using = bash_blocks(section(README.read_text(), "Using it"))[0]
    assert using[0].startswith("source .venv/bin/activate"), "bare `lmpipe` needs the venv activated"
    for line in using:
        if "$WT2" in line:
            assert "--doc-split heading" in line, f"WikiText is split by article: {line}"
        if line.startswith("lmpipe tokenizer train"):
            assert "test.txt" not in line and "*" not in line, "the tokenizer never sees the test split"


def test_the_readme_lists_every_gpu_check_stage():
    """scripts/gpu_check.sh's stages (the ones its `case` accepts) are the ones its usage line and the README
    name: a stage added to the script is documented, and a documented one runs."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    accepted = re.search(r"^\s*((?:[\w-]+\|)+[\w-]+)\) ;;$", script, re.M)
    usage = re.search(r"gpu_check\.sh \[([\w|-]+)\]", script)
    readme = re.search(r"`scripts/gpu_check\.sh \[([\w|-]+)\]`", README.read_text())
    assert accepted and usage and readme
    stages = accepted.group(1).split("|")
    assert usage.group(1).split("|") == stages
    assert readme.group(1).split("|") == stages
