"""The examples run as a user runs them (`python examples/x.py ...`), on CPU, and do what they say."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port_pair, lmpipe_env


def run_example(name: str, *args: str) -> str:
    base = lmpipe_env()  # this checkout's lmpipe, as if installed, before any path the machine needs
    env = {**base, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, str(REPO / "examples" / name), "--port", str(free_port_pair()), *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return p.stdout


def test_plain_loop_trains():
    out = run_example("plain_loop.py", "--steps", "20")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert "trained 20 steps" in out and losses[-1] < losses[0], out


def test_a_transformers_model_trains_through_the_loader():
    pytest.importorskip("transformers")
    out = run_example("hf_model.py", "--steps", "8")
    first, last = (float(x) for x in re.search(r"loss (\S+) -> (\S+);", out).groups())  # type: ignore[union-attr]
    assert last < first and "tokens/s" in out, out


def test_resume_goes_on_from_the_users_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    out = run_example("resume.py", "--steps", "6", "--ckpt", ckpt)
    assert "saved at step 6" in out and "done at step 6" in out, out
    out = run_example("resume.py", "--steps", "9", "--ckpt", ckpt)
    assert "resumed at step 6" in out and "saved at step 9" in out and "done at step 9" in out, out


@pytest.mark.cuda
def test_the_examples_train_on_the_gpu():
    """Pinned slots, the copy stream and the batch dict's device tensors (the document offsets included)."""
    out = run_example("plain_loop.py", "--steps", "20", "--device", "cuda")
    assert "trained 20 steps" in out, out
    if importlib.util.find_spec("transformers"):
        out = run_example("hf_model.py", "--steps", "8", "--device", "cuda")
        assert "tokens/s" in out, out
