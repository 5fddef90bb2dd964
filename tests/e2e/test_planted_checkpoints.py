"""Issue 35 item 3: a resume trusts only checkpoints that this user owns and that only this user can write.

A real run writes checkpoints (under umask 002, which would make them group-writable if lmpipe left the
mode to it); then each way another user could have planted or changed one makes `--resume auto` (or an
explicit --resume) refuse in one line, exit 2, touching nothing. Before, the checkpoint's owner and mode
were never looked at: a step folder of `nobody`'s was resumed silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmpipe.consumer.checkpoint import CheckpointManager
from tests.helpers import REPO, Procs, lmpipe_env

NOBODY = 65534
SMALL = ["--builtin-docs", "240", "--seq-len", "64", "--batch-size", "4", "--metrics-port", "-1"]


def _made_with_umask_002() -> None:
    os.umask(0o002)


@pytest.fixture
def checkpoints(procs: Procs, tmp_path: Path, port: int) -> tuple[Path, list[str]]:
    ck = tmp_path / "ck"
    base = ["--port", str(port), "--producers", "1", *SMALL, "--checkpoint-dir", str(ck)]
    out = subprocess.run([sys.executable, "-m", "lmpipe", "run", *base, "--steps", "4", "--checkpoint-every", "2"],
                         cwd=REPO, env=lmpipe_env(), capture_output=True, text=True, timeout=180,
                         preexec_fn=_made_with_umask_002)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return ck, base


def _resume(
    procs: Procs, base: list[str], name: str, resume: str = "auto", cmd: str = "train"
) -> tuple[int, str]:
    """`train` stops at a refusal before it waits for producers; `run` trains with its own."""
    p = procs.start(cmd, *base, "--steps", "6", "--resume", resume, name=name)
    code = procs.wait(p, 90)
    return code, procs.log(p)


def _refused(lmpipe_cli, base: list[str], expect: str, resume: str = "auto") -> None:
    """`train` refuses before it binds a socket: run in this process, not as one of its own (4 CPU-seconds of
    imports apiece)."""
    r = lmpipe_cli("train", *base, "--steps", "6", "--resume", resume)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    lines = [ln for ln in text.splitlines() if expect in ln]
    assert lines and "not resumed" in lines[0], text
    assert "Traceback" not in text and "resumed from" not in text, text


def test_group_or_other_writable_checkpoints_are_refused(procs, checkpoints, lmpipe_cli):
    ck, base = checkpoints
    step = CheckpointManager(ck).latest()
    assert step is not None and step.name == "step-00000004"
    for path in (ck, step, step / "header.json", step / "state.pt"):  # lmpipe wrote them private
        assert not path.stat().st_mode & 0o022, oct(path.stat().st_mode)
    for path, mode, who in (
        (step, 0o757, "others"),
        (step / "state.pt", 0o664, "its group"),
        (ck, 0o775, "its group"),
    ):
        old = path.stat().st_mode & 0o777
        path.chmod(mode)
        _refused(lmpipe_cli, base, f"{path} is writable by {who}")
        path.chmod(old)
    step.chmod(0o777)
    _refused(lmpipe_cli, base, f"{step} is writable by others", resume=str(step))
    step.chmod(0o755)
    code, text = _resume(procs, base, "trusted", cmd="run")  # the same checkpoint, private again
    assert code == 0 and "resumed from" in text and "step 4" in text, text


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to make a checkpoint belong to another user (nobody)"
)
def test_a_checkpoint_of_another_user_is_refused(checkpoints, lmpipe_cli):
    ck, base = checkpoints
    step = CheckpointManager(ck).latest()
    assert step is not None
    planted = ck / "step-00000006"  # ahead of ours, as an attacker plants it (cursors moved on)
    shutil.copytree(step, planted)
    for path in (planted, *planted.iterdir()):
        os.chown(path, NOBODY, NOBODY)
    (ck / "latest").write_text(planted.name + "\n")  # as could anyone who can write in the folder
    _refused(lmpipe_cli, base, f"{planted} belongs to uid {NOBODY}, not to this user")
    _refused(lmpipe_cli, base, f"{planted} belongs to uid {NOBODY}", resume=str(planted))
    os.chown(ck, NOBODY, NOBODY)
    shutil.rmtree(planted)
    _refused(lmpipe_cli, base, f"{ck} belongs to uid {NOBODY}")
