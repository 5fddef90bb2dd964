"""lmpipe's processes run torch's OpenMP threads with OMP_WAIT_POLICY=PASSIVE unless the user set it (cli.main):
spinning threads beside the producers on the same cores took 1.6x the CPU time. libgomp reads the variable
once, when torch loads, and says what it read when OMP_DISPLAY_ENV is set: unset, it shows PASSIVE too but
spins 300,000 times before it sleeps (GOMP_SPINCOUNT); PASSIVE spins 0 times."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, lmpipe_env


def spin_count(env_extra: dict[str, str], nowhere: Path) -> int:
    """How long libgomp's idle threads spin in `lmpipe train` (which imports torch, then finds no checkpoint
    at `nowhere` to resume)."""
    env = {k: v for k, v in lmpipe_env().items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update({"OMP_DISPLAY_ENV": "verbose", **env_extra})
    cmd = ["train", "--device", "cpu", "--metrics-port", "-1", "--resume", str(nowhere)]
    r = subprocess.run([sys.executable, "-m", "lmpipe", *cmd], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=120)  # fmt: skip
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", r.stderr + r.stdout)
    if found is None:
        pytest.skip("this torch build's OpenMP does not display its settings (not libgomp)")
    return int(found.group(1))


def test_the_threads_wait_passively_unless_the_user_says_otherwise(tmp_path):
    assert spin_count({}, tmp_path / "none") == 0
    assert spin_count({"OMP_WAIT_POLICY": "active"}, tmp_path / "none") > 0
