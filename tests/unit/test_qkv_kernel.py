"""The q/k/v projection whose backward reads dq, dk, dv where they are (consumer/fast/qkv_kernel.py) computes what
the plain projection does: its Triton GEMM in Triton's interpreter, the autograd wiring eager and compiled
on CPU (no concatenation of the three gradients left in inductor's code), and the whole model on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import mix
from lmpipe.shared.config import PipelineConfig
from tests.helpers import compiled_bf16_steps

pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
from lmpipe.consumer.fast import qkv_kernel as K  # noqa: E402  # Triton, checked above


def _attention(x, w, kernel: bool):
    from lmpipe.consumer.fast.qkv_kernel import qkv

    B, L, C = x.shape
    q, k, v = qkv(x, w) if kernel else F.linear(x, w).split(C, -1)
    q, k, v = (t.view(B, L, 4, C // 4).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, C)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_projection_gives_the_plain_projections_values_and_gradients(compiled):
    from torch._inductor.utils import run_and_get_code

    results = []
    for kernel in (True, False):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 32, 64, generator=g, requires_grad=True)
        w = torch.randn(192, 64, generator=g, requires_grad=True)
        fn = torch.compile(_attention, fullgraph=True) if compiled else _attention

        def step(fn=fn, x=x, w=w, kernel=kernel):
            y = fn(x, w, kernel)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            return y

        if compiled:
            y, code = run_and_get_code(step)
            source = "\n".join(code)
            # the kernel's backward is its own op, given the three gradients as they are; autograd's
            # projection concatenates them first
            assert ("qkv_backward" in source, "cat" in source) == ((True, False) if kernel else (False, True))
        else:
            y = step()
        results.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_cpu_trainer_keeps_autograds_projection():
    tcfg = TrainConfig(model="tiny", compile=False, metrics_port=None)
    built = build(PipelineConfig(seq_len=64), tcfg, 512, torch.device("cpu"), "fp32", None, Dist())
    assert not any(isinstance(b.attn, K.QKVProjection) for b in built.model.transformer.h)


@pytest.mark.cuda
def test_a_compiled_gpt_trains_alike_with_and_without_the_qkv_kernel():
    """Whole model, torch.compile, FlexAttention and autocast bf16 as the trainer runs it: one step's loss
    and gradients; and a bf16 CUDA trainer takes the kernel, an fp16 one does not."""

    def switch(model, on):
        for b in model.transformer.h:
            if on:
                mix(b.attn, K.QKVProjection)

    (loss_off, grads_off), (loss_on, grads_on) = compiled_bf16_steps(switch)
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=0)  # the forward is the same GEMM
    for (name, a), (_, b) in zip(grads_on, grads_off):
        assert (a - b).norm() <= 0.01 * b.norm(), name  # bf16 rounding apart; a wrong block is ~100%

    pcfg = PipelineConfig(seq_len=64)
    gpt2 = TrainConfig(model="gpt2-124m", compile=False, fast="auto,qkv-backward", metrics_port=None)
    on = build(pcfg, gpt2, 512, torch.device("cuda"), "bf16", torch.bfloat16, Dist())
    assert all(isinstance(b.attn, K.QKVProjection) for b in on.model.transformer.h)
    default = build(
        pcfg, replace(gpt2, fast="auto"), 512, torch.device("cuda"), "bf16", torch.bfloat16, Dist()
    )
    assert not any(isinstance(b.attn, K.QKVProjection) for b in default.model.transformer.h)  # opt-in
    # named, it is refused in one line where it cannot run: fp16, or a host-bound model's width
    with pytest.raises(ValueError, match="--fast qkv-backward: it needs --precision bf16"):
        build(pcfg, gpt2, 512, torch.device("cuda"), "fp16", torch.float16, Dist())
    with pytest.raises(ValueError, match="under 768"):
        build(pcfg, replace(gpt2, model="tiny"), 512, torch.device("cuda"), "bf16", torch.bfloat16, Dist())


@pytest.mark.cuda
@pytest.mark.parametrize("m, c", [(4096, 768), (1000, 256)])
def test_the_input_gradient_kernel_is_as_close_to_fp32_as_torchs_bf16_gemm(m, c):
    from lmpipe.consumer.fast.qkv_kernel import input_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    d = [torch.randn(m, c, device="cuda", generator=g) for _ in range(3)]
    w = torch.randn(3 * c, c, device="cuda", generator=g) * c**-0.5
    want = torch.cat(d, 1) @ w
    plain = (torch.cat(d, 1).bfloat16() @ w.bfloat16()).float()
    got = input_grad(*(t.bfloat16() for t in d), w.bfloat16()).float()
    scale = want.abs().max()
    assert (got - want).abs().max() / scale <= 2 * (plain - want).abs().max() / scale + 1e-3
