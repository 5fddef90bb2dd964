"""deploy/slurm's scripts, checked statically; tests/e2e/deploy/test_slurm.py runs them on a real Slurm."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests import slurmbed
from tests.helpers import REPO

SLURM = REPO / "deploy" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_are_valid_bash_and_strict(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "set -euo pipefail" in script.read_text()


def test_the_batch_job_is_heterogeneous_requeueable_and_finds_the_trainer_through_slurm():
    text = (SLURM / "lmpipe.sbatch").read_text()
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH hetjob" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --open-mode=append" in header, "a requeued job appends to its log"
    for script in SCRIPTS:
        body = script.read_text()
        # the trainer's address: Slurm's node list and node address, never a name written in the script
        assert "scontrol show hostnames" in body and "NodeAddr=" in body
        assert "--resume auto" in body or "lmpipe.sbatch" not in script.name
        hosts = set(re.findall(r"--host (\S+)", body))
        assert hosts <= {'"$addr"', "0.0.0.0"} and '"$addr"' in hosts, (script.name, hosts)
    assert '--curve-dir "$RUN_DIR/keys"' in text and '--checkpoint-dir "$RUN_DIR/checkpoints"' in text


def test_the_cluster_test_says_what_to_install_when_slurm_is_missing(monkeypatch):
    monkeypatch.setattr(slurmbed.shutil, "which", lambda name: None)
    real = slurmbed.Path
    monkeypatch.setattr(slurmbed, "Path", lambda *a: real("/nonexistent", *a[1:]))
    with pytest.raises(slurmbed.SlurmUnavailable, match="apt-get install slurm-wlm munge"):
        slurmbed.check_available()
