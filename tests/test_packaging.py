"""The installed distribution has one import name, `lmpipe`, and nothing in a user's directory shadows it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.helpers import REPO, lmpipe_env


def test_wheel_has_lmpipe_as_its_only_top_level_name(tmp_path):
    src = tmp_path / "src"  # built from a copy: setuptools leaves build/ beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("lmpipe", "producer", "consumer", "shared"):
        shutil.copytree(REPO / pkg, src / pkg, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path,
            src,
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lmpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"lmpipe"}, top
    for pkg in ("producer", "consumer", "shared"):
        assert f"lmpipe/{pkg}/__init__.py" in names
    assert "lmpipe/shared/assets/builtin-tokenizer.json" in names  # package data travels too


def test_a_decoy_shared_package_in_the_working_directory_changes_nothing(tmp_path: Path):
    """`lmpipe run` from the checkout's parent (which holds the team's `shared/` folder) must not pick it up."""
    for name in ("shared", "producer", "consumer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    code = "import lmpipe.producer.manager, lmpipe.consumer.receiver, lmpipe.shared.wire, lmpipe; print(lmpipe.__version__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=lmpipe_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and out.stdout.strip() != "0+unknown"  # the version comes from the metadata
    out = subprocess.run(
        [sys.executable, "-m", "lmpipe.producer", "--help"],
        cwd=tmp_path,
        env=lmpipe_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "--worker" in out.stdout, out.stderr


def test_one_tree_the_import_tree_is_the_source_tree():
    """lmpipe/producer, lmpipe/consumer and lmpipe/shared are links to the folders at the top, so every tool
    (mypy, an editor, the editable install) sees one tree; mypy checks it whole."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["mypy"]["files"] == ["lmpipe"]
    assert "package-dir" not in project["tool"]["setuptools"]
    for pkg in ("producer", "consumer", "shared"):
        link = REPO / "lmpipe" / pkg
        assert link.is_symlink() and link.resolve() == (REPO / pkg).resolve(), f"lmpipe/{pkg} must link ../{pkg}"
