"""Two GPUs under torchrun: the training step, DDP's all-reduces included, runs as CUDA graphs and trains the
model the eager DDP step trains. Needs two CUDA GPUs (scripts/gpu_check.sh on a 2-GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_lmpipe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

COMMON = ["--producers", "1", "--epochs", "0", "--steps", "40", "--builtin-docs", "2000", "--seq-len", "256",
          "--batch-size", "8", "--model", "small", "--metrics-port", "-1", "--log-every", "5"]  # fmt: skip


def test_ddp_step_as_cuda_graphs_trains_like_the_eager_step(tmp_path, port):
    runs = {}
    for name, fast in (("graphs", "auto,step-graph"), ("eager", "auto")):
        summary = tmp_path / f"{name}.json"
        rc, text = run_lmpipe(tmp_path, name, "run", *COMMON, "--fast", fast, "--port", str(port),
                              "--summary-json", str(summary), nproc=2, timeout=400)  # fmt: skip
        assert rc == 0, text[-3000:]
        captured = "the training step runs as CUDA graphs" in text
        assert captured == (name == "graphs"), text[-3000:]
        assert "cannot be captured" not in text, text[-3000:]
        runs[name] = json.loads(summary.read_text())
    graphs, eager = runs["graphs"], runs["eager"]
    assert graphs["steps"] == eager["steps"] == 40 and graphs["tokens"] == eager["tokens"]
    assert graphs["first_loss"] - graphs["last_loss"] > 1.0, graphs["losses"]
    # the same documents in the same order: the curves agree within bf16's rounding, step for step
    for a, b in zip(graphs["losses"], eager["losses"]):
        assert abs(a - b) < 0.02 * b, (graphs["losses"], eager["losses"])
