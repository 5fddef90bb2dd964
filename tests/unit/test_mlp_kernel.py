"""The MLP with its GELU in cuBLASLt's GEMM epilogues (consumer/fast/mlp_kernel.py) computes what the plain MLP does."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import PATHS, mix
from lmpipe.consumer.fast import unavailable as path_unavailable
from lmpipe.consumer.fast.cublaslt import nvmath_missing
from lmpipe.consumer.fast.mlp_kernel import EpilogueMLP, unavailable
from lmpipe.consumer.model import GPTConfig
from lmpipe.shared.config import PipelineConfig
from tests.helpers import compiled_bf16_steps


def _built(device: str = "cuda", precision: str = "bf16", **model) -> SimpleNamespace:
    tcfg = TrainConfig(model="tiny", metrics_port=None)
    return SimpleNamespace(device=torch.device(device), precision=precision, tcfg=tcfg,
                           model=SimpleNamespace(config=GPTConfig(**model)))  # fmt: skip


def test_the_epilogues_say_why_they_cannot_run():
    path = next(p for p in PATHS if p.name == "gelu-epilogue")
    assert "needs CUDA, not cpu" in (path_unavailable(path, _built("cpu")) or "")  # type: ignore[arg-type]
    assert "biases" in (unavailable(_built(bias=True)) or "")  # type: ignore[arg-type]
    assert "multiple of 8" in (unavailable(_built(n_embd=100)) or "")  # type: ignore[arg-type]
    assert "bf16, not fp16" in (unavailable(_built(precision="fp16")) or "")  # type: ignore[arg-type]


def test_a_cpu_trainer_keeps_the_plain_mlp():
    tcfg = TrainConfig(model="tiny", compile=False, metrics_port=None)
    assert tcfg.fast == "auto"  # on by default: it applies where it can run
    built = build(PipelineConfig(seq_len=64), tcfg, 512, torch.device("cpu"), "fp32", None, Dist())
    assert not any(isinstance(b.mlp, EpilogueMLP) for b in built.model.transformer.h)
    assert "gelu-epilogue (it needs CUDA, not cpu)" in built.fast_line


def _need_nvmath():
    if (why := nvmath_missing()) is not None:
        pytest.skip(why)


def _reference(x, w_fc, w_proj):
    return F.linear(F.gelu(F.linear(x, w_fc), approximate="tanh"), w_proj)


@pytest.mark.cuda
@pytest.mark.parametrize("n, c", [(4096, 128), (2048, 768)])
def test_epilogue_mlp_matches_the_tanh_gelu_mlp_forward_and_backward(n, c):
    """Against fp32: no further from it than the same MLP in plain bf16 ops, and far from the erf GELU's."""
    _need_nvmath()
    from lmpipe.consumer.fast.mlp_kernel import mlp

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, c, device="cuda", generator=g)
    w_fc = torch.randn(4 * c, c, device="cuda", generator=g) * c**-0.5
    w_proj = torch.randn(c, 4 * c, device="cuda", generator=g) * (4 * c) ** -0.5
    dy = torch.randn(n, c, device="cuda", generator=g)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (x, w_fc, w_proj)]
        y = fn(*leaves)
        return [y.float(), *(t.float() for t in torch.autograd.grad(y, leaves, dy.to(dtype)))]

    want = run(_reference, torch.float32)
    plain = run(_reference, torch.bfloat16)
    got = run(mlp, torch.bfloat16)
    erf = run(lambda a, b, c_: F.linear(F.gelu(F.linear(a, b)), c_), torch.float32)
    for name, w, p, g_ in zip(("y", "dx", "dw_fc", "dw_proj"), want, plain, got):
        scale = w.abs().max()
        err, plain_err = (g_ - w).abs().max() / scale, (p - w).abs().max() / scale
        assert err <= 2 * plain_err + 1e-3, (name, float(err), float(plain_err))
        assert err < 2e-2, (name, float(err))
    # the GELU is the tanh one GPT-2 uses: its output is nearer tanh's than erf's
    assert (got[0] - want[0]).abs().mean() < (got[0] - erf[0]).abs().mean()


@pytest.mark.cuda
def test_a_compiled_gpt_trains_alike_with_and_without_the_epilogues():
    """Whole model, torch.compile and autocast bf16 as the trainer runs it: one step's loss and gradients."""
    _need_nvmath()

    def switch(model, on):
        for b in model.transformer.h:
            if on:
                mix(b.mlp, EpilogueMLP)

    (loss_off, grads_off), (loss_on, grads_on) = compiled_bf16_steps(switch)
    torch.testing.assert_close(loss_on, loss_off, rtol=2e-3, atol=0)
    for (name, a), (_, b) in zip(grads_on, grads_off):
        assert (a - b).norm() <= 0.03 * b.norm(), name  # bf16 rounding apart; a wrong gelu' is ~100%


@pytest.mark.cuda
def test_a_bf16_cuda_trainer_takes_the_epilogues_and_says_so(caplog):
    _need_nvmath()
    tcfg = TrainConfig(model="tiny", compile=False, metrics_port=None)
    pcfg = PipelineConfig(seq_len=64)
    with caplog.at_level(logging.INFO, logger="lmpipe.trainer"):
        on = build(pcfg, tcfg, 512, torch.device("cuda"), "bf16", torch.bfloat16, Dist())
        fp16 = build(pcfg, tcfg, 512, torch.device("cuda"), "fp16", torch.float16, Dist())
        graphs = TrainConfig(model="tiny", compile=True, compile_mode="reduce-overhead", metrics_port=None)
        graphed = build(pcfg, graphs, 512, torch.device("cuda"), "bf16", torch.bfloat16, Dist())
    assert all(isinstance(b.mlp, EpilogueMLP) for b in on.model.transformer.h)
    assert not any(isinstance(b.mlp, EpilogueMLP) for b in fp16.model.transformer.h)
    assert not any(isinstance(b.mlp, EpilogueMLP) for b in graphed.model.transformer.h)
    said = caplog.text + fp16.fast_line + graphed.fast_line  # the --fast line is the trainer's to log
    assert "gelu-epilogue" in on.fast and "needs --precision bf16, not fp16" in fp16.fast_line
    assert "reduce-overhead records CUDA graphs" in said


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", [None, "GELU_AUX", "DGELU"])
def test_a_gemm_straight_to_cublaslt_equals_nvmaths_execute(epilogue, monkeypatch):
    """After its first call plans a shape, cublaslt.gemm calls cuBLASLt itself with the plan's descriptors
    and algorithm (consumer/fast/cublaslt.py): the same bits as nvmath's execute(), on new operands each call,
    the epilogue's auxiliary input and output included."""
    _need_nvmath()
    from nvmath.linalg.advanced import MatmulEpilog

    from lmpipe.consumer.fast import cublaslt

    monkeypatch.setattr(cublaslt, "_plans", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, m = 512, 256, 1024  # [m, n] column-major result, as the MLP's GEMMs make them
    epilog = getattr(MatmulEpilog, epilogue) if epilogue else None

    def operands():
        a = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16).T
        aux = (
            torch.randn(n, m, device="cuda", generator=g, dtype=torch.bfloat16).T
            if epilogue == "DGELU"
            else None
        )
        return a, b, aux

    cublaslt.gemm(*operands()[:2], epilog, operands()[2])  # plans the shape
    for _ in range(3):
        a, b, aux = operands()
        monkeypatch.setattr(cublaslt, "DIRECT", True)
        direct = cublaslt.gemm(a, b, epilog, aux)
        monkeypatch.setattr(cublaslt, "DIRECT", False)
        executed = cublaslt.gemm(a, b, epilog, aux)
        if epilogue == "GELU_AUX":
            (direct, made), (executed, want) = direct, executed
            assert made.keys() == want.keys() == {"gelu_aux"}
            assert torch.equal(made["gelu_aux"], want["gelu_aux"])
            assert made["gelu_aux"].stride() == want["gelu_aux"].stride()
        elif epilogue == "DGELU":
            direct, executed = (t[0] if isinstance(t, tuple) else t for t in (direct, executed))
        assert direct.shape == executed.shape and direct.stride() == executed.stride()
        assert torch.equal(direct, executed)
        if epilogue is None:  # and both are the product, not two copies of one mistake
            torch.testing.assert_close(direct.float(), a.float() @ b.float(), rtol=2e-2, atol=5e-2)
