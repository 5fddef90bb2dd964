"""torch is an extra: a producer-only host (no torch) runs `lmpipe produce` against a trainer elsewhere, and
the trainer's commands there say in one line how to add it. "No torch" is a process in which `import torch`
fails, as where it is not installed (a sitecustomize that blocks it)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import free_port_pair, lmpipe_env

BLOCK = """import sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is not installed
"""


def without_torch(tmp: Path) -> dict[str, str]:
    (tmp / "block").mkdir()
    (tmp / "block" / "sitecustomize.py").write_text(BLOCK)
    env = lmpipe_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / "block"), env.get("PYTHONPATH")]))
    return env


def test_a_producer_without_torch_feeds_a_trainer(procs, tmp_path):
    env = without_torch(tmp_path)
    port = free_port_pair()
    common = ["--port", str(port), "--producers", "1", "--builtin-docs", "60", "--seq-len", "64",
              "--batch-size", "4", "--epochs", "1"]  # fmt: skip
    trainer = procs.start("train", *common, "--steps", "0", "--metrics-port", "-1", name="trainer")
    procs.wait_for(trainer, "listening on", timeout=60)
    producer = procs.start(
        "produce", *common, "--worker", "0", "--metrics-port", "-1", name="producer", env=env
    )
    assert trainer.wait(timeout=120) == 0, procs.log(trainer)[-3000:]
    assert "(end of data)" in procs.log(trainer)
    assert producer.wait(timeout=30) == 0, procs.log(producer)[-3000:]
    assert "torch" not in procs.log(producer)

    run = procs.start("run", "--steps", "1", name="run", env=env)
    assert run.wait(timeout=60) == 2
    (line,) = procs.log(run).strip().splitlines()
    assert line.startswith("lmpipe run: the trainer needs PyTorch") and "pip install 'lmpipe[train]'" in line
