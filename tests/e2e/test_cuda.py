"""GPU behaviour: flash for unpacked rows, exact FlexAttention for packed rows, copy-stream slots, fused
loss, compile with bounded shapes, and the trainer end to end on CUDA. Skipped without a GPU."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cuda


def test_trainer_end_to_end_on_cuda(procs, tmp_path, port):
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--port", str(port), "--steps", "40", "--log-every", "10", "--metrics-port", "-1",
        "--model", "small", "--seq-len", "256", "--summary-json", str(summary), name="run",
    )  # fmt: skip
    assert p.wait(timeout=300) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["first_loss"] - out["last_loss"] > 1.0
    assert "on cuda (bf16)" in procs.log(p)


def test_fp16_dynamic_scaling_end_to_end(procs, tmp_path, port):
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--port", str(port), "--steps", "40", "--log-every", "10", "--metrics-port", "-1",
        "--precision", "fp16", "--loss-scale", "dynamic", "--summary-json", str(summary), name="run",
    )  # fmt: skip
    assert p.wait(timeout=300) == 0, procs.log(p)
    assert "| scale " in procs.log(p)
    out = json.loads(summary.read_text())
    assert out["last_loss"] < out["first_loss"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--compile", "--compile-mode", "reduce-overhead"],
        ["--precision", "fp8", "--compile"],
        ["--compile", "--compile-mode", "autotune-attention"],
    ],
    ids=["cuda-graphs", "fp8", "autotune-attention"],
)
def test_cuda_graphs_and_fp8_train(procs, tmp_path, port, extra):
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--port", str(port), "--steps", "60", "--log-every", "10", "--metrics-port", "-1",
        "--model", "small", "--seq-len", "256", "--summary-json", str(summary), *extra, name="run",
    )  # fmt: skip
    assert p.wait(timeout=600) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["first_loss"] - out["last_loss"] > 1.0, out
    if "fp8" in extra:
        assert "linear layers use torchao float8 matmuls" in procs.log(p)


def test_compile_keeps_bucket_shapes_bounded(procs, tmp_path, port):
    summary = tmp_path / "s.json"
    p = procs.start(
        "run", "--port", str(port), "--steps", "30", "--log-every", "10", "--metrics-port", "-1",
        "--strategy", "bucket", "--pad-multiple", "64", "--seq-len", "128", "--compile",
        "--summary-json", str(summary), name="run",
    )  # fmt: skip
    assert p.wait(timeout=600) == 0, procs.log(p)
    graphs = json.loads(summary.read_text())["compiled_graphs"]
    # widths are 64 or 128 and rows always --batch-size: 2 shapes; one graph per batch would be ~30
    assert 1 <= graphs <= 6, graphs
