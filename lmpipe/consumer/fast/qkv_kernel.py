"""Path qkv-backward: the attention's q/k/v projection with a backward that reads dq, dk and dv where they are
(CUDA, Triton).

Attention's backward returns dq, dk and dv as three tensors. The projection's backward as autograd writes it
needs them side by side, one [tokens, 3C] gradient for one input-gradient GEMM and one weight-gradient GEMM,
so inductor copies all three into it first. Here the input gradient dx = dq Wq + dk Wk + dv Wv is one Triton GEMM
whose K loop reads each of the three in turn, and the weight gradient is three cuBLAS GEMMs, one per block of
rows. The forward is the one GEMM it was; q, k and v are views of its output as before. The backward takes
0.89-0.91x the time on an H100, but the step gains within noise (consumer/fast/__init__.py: opt-in;
bench/results/qkv-h100-2026-11-27.md). It runs for bf16 CUDA models without biases, of hidden size 768 and up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmpipe.consumer.fast import mix
from lmpipe.consumer.model import CausalSelfAttention

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built


def _configs() -> list[triton.Config]:
    tiles = [
        (128, 128, 64, 4, 8),
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 3, 4),
        (128, 64, 64, 4, 4),
    ]
    return [triton.Config({"BM": m, "BN": n, "BK": k}, num_stages=s, num_warps=w) for m, n, k, s, w in tiles]


@triton.autotune(configs=_configs(), key=["M", "C"])
@triton.jit
def _dx(dq, dk, dv, w, out, M, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [M, C] = dq w[:C] + dk w[C:2C] + dv w[2C:]; dq, dk, dv [M, C] and w [3C, C], all row-major.
    Programs sharing a block of rows run side by side (n fastest), so each is read from memory once."""
    n_blocks = tl.cdiv(C, BN)
    pid = tl.program_id(0)
    rm = (pid // n_blocks) * BM + tl.arange(0, BM)
    rn = (pid % n_blocks) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rows = rm.to(tl.int64)[:, None] * C
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, 3 * C, BK):  # C % BK == 0: a step of K lies in one of the three
        which = k // C
        a = tl.where(which == 0, dq, tl.where(which == 1, dk, dv))
        a_tile = tl.load(a + rows + (k - which * C + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w_tile = tl.load(w + (k + rk)[:, None] * C + rn[None, :], mask=rn[None, :] < C, other=0.0)
        acc = tl.dot(a_tile, w_tile, acc)
    mask = (rm[:, None] < M) & (rn[None, :] < C)
    tl.store(out + rows + rn[None, :], acc.to(out.dtype.element_ty), mask=mask)


def input_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dq w[:C] + dk w[C:2C] + dv w[2C:] by the Triton kernel; dq, dk, dv [M, C] contiguous, w [3C, C]."""
    M, C = dq.shape
    out = dq.new_empty(M, C)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(C, meta["BN"]),)  # noqa: E731
    _dx[grid](dq, dk, dv, w, out, M, C)
    return out


@torch.library.custom_op("lmpipe::qkv_backward", mutates_args=())
def qkv_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dx [n, C], dw [3C, C]) for q, k, v = split(x w^T); every tensor [rows, cols] row-major."""
    C = x.shape[1]
    if dq.is_cuda:
        dx = input_grad(dq, dk, dv, w)
    else:  # CPU (tests): the same sums by torch
        dx = dq @ w[:C] + dk @ w[C : 2 * C] + dv @ w[2 * C :]
    dw = w.new_empty(w.shape)
    for i, d in enumerate((dq, dk, dv)):  # rows i*C.. of dw: contiguous, so the GEMM writes them in place
        torch.mm(d.T, x, out=dw[i * C : (i + 1) * C])
    return dx, dw


@qkv_backward.register_fake
def _(dq, dk, dv, x, w):
    return torch.empty_like(x), torch.empty_like(w)


class _Projection(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, w).split(x.shape[-1], dim=-1))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, w = ctx.saved_tensors
        return qkv_backward(dq.contiguous(), dk.contiguous(), dv.contiguous(), x, w)


def qkv(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v = split(x w^T) for a bias-free projection; x [..., C] in the autocast dtype, w [3C, C]."""
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    shape = x.shape
    q, k, v = _Projection.apply(x.reshape(-1, shape[-1]).to(dt).contiguous(), w.to(dt))
    return q.view(shape), k.view(shape), v.view(shape)


class QKVProjection(CausalSelfAttention):
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.is_cuda:
            return qkv(x, self.c_attn.weight)
        return super().project(x)


def unavailable(built: Built) -> str | None:
    cfg = built.model.config
    if built.precision != "bf16":
        return f"it needs --precision bf16, not {built.precision}"
    if cfg.bias:
        return "the model has biases"
    if cfg.n_embd % 64:  # the kernel's K steps of 64 each lie in one of q, k, v
        return f"n_embd {cfg.n_embd} is not a multiple of 64"
    if cfg.n_embd < 768:
        # a smaller model's step is host-bound (bench/results/overhead-*.md): a custom op's dispatch costs more
        return f"n_embd {cfg.n_embd} is under 768, where the op's dispatch costs more than the copy it saves"
    return None


def apply(built: Built) -> None:
    for module in built.model.modules():
        if isinstance(module, CausalSelfAttention):
            mix(module, QKVProjection)
