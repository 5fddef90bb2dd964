"""Path gelu-epilogue: GPT-2's MLP with the GELU and its gradient inside cuBLASLt's GEMMs (nvmath-python),
CUDA and bf16 only.

Compiled, the MLP's GELU and its gradient run as kernels of their own, each a full pass over the [tokens, 4C]
activation. 1.028-1.037x tokens/s on GPT-2 124M at 32 rows on an H100 (bench/results/gelu-epilogue-h100-2026-11-27.md). cuBLASLt
does both inside the GEMMs around them: c_fc's GEMM applies the GELU as it writes and keeps its input as an
auxiliary output (epilogue GELU_AUX), and c_proj's input-gradient GEMM multiplies by gelu'(that input) as
it writes (DGELU). torch exposes neither (its `_addmm_activation` recomputes the GEMM for the backward), so
the two GEMMs come from nvmath-python, NVIDIA's binding of cuBLASLt, behind two custom ops that
torch.compile treats as opaque calls.

cuBLASLt is column-major: each GEMM is written on transposes, so that a column-major [4C, tokens] result is
the row-major [tokens, 4C] activation the next GEMM reads, with no copy.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from lmpipe.consumer.fast import cublaslt, mix
from lmpipe.consumer.model import MLP

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built


def unavailable(built: Built) -> str | None:
    """Why the GELU epilogues cannot run in this build, or None."""
    tcfg, cfg = built.tcfg, built.model.config
    if built.precision != "bf16":
        return f"it needs --precision bf16, not {built.precision}"
    if tcfg.compile and tcfg.compile_mode in ("reduce-overhead", "max-autotune"):
        # nvmath keeps a cuBLASLt workspace between calls; a CUDA graph's private memory pool refuses it
        return f"--compile-mode {tcfg.compile_mode} records CUDA graphs, which nvmath's calls cannot join"
    if cfg.bias:
        return "the model has biases (only bias-free MLPs, GPT-2 presets' default, take the epilogues)"
    if cfg.n_embd % 8:
        return f"n_embd {cfg.n_embd} is not a multiple of 8 (cuBLASLt's auxiliary output needs it)"
    return cublaslt.nvmath_missing()


def apply(built: Built) -> None:
    for module in built.model.modules():
        if isinstance(module, MLP):
            mix(module, EpilogueMLP)


@functools.cache
def _epilogs():
    from nvmath.linalg.advanced import MatmulEpilog

    return MatmulEpilog.GELU_AUX, MatmulEpilog.DGELU


@torch.library.custom_op("lmpipe::mlp_gelu", mutates_args=())
def mlp_gelu(
    x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, C], w_fc [4C, C], w_proj [C, 4C] -> (gelu(x w_fc^T) w_proj^T, gelu(x w_fc^T), x w_fc^T)."""
    gelu_aux, _ = _epilogs()
    hT, aux = cublaslt.gemm(w_fc, x.T, gelu_aux, None)  # [4C, n] column-major: h [n, 4C] row-major
    h, pre = hT.T, aux["gelu_aux"].T
    return h @ w_proj.T, h, pre


@mlp_gelu.register_fake
def _(x, w_fc, w_proj):
    n, hidden = x.shape[0], w_fc.shape[0]
    return x.new_empty(n, w_proj.shape[0]), x.new_empty(n, hidden), x.new_empty(n, hidden)


@torch.library.custom_op("lmpipe::mlp_gelu_backward", mutates_args=())
def mlp_gelu_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    pre: torch.Tensor,
    w_fc: torch.Tensor,
    w_proj: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx, dw_fc, dw_proj); the GELU's gradient rides in the GEMM that makes dh = dy w_proj."""
    _, dgelu = _epilogs()
    dpreT = cublaslt.gemm(w_proj.T, dy.T, dgelu, pre.T)  # [4C, n] column-major: dpre [n, 4C] row-major
    dpre = (dpreT[0] if isinstance(dpreT, tuple) else dpreT).T
    return dpre @ w_fc, dpre.T @ x, dy.T @ h


@mlp_gelu_backward.register_fake
def _(dy, x, h, pre, w_fc, w_proj):
    return torch.empty_like(x), torch.empty_like(w_fc), torch.empty_like(w_proj)


def _setup_context(ctx, inputs, output):
    x, w_fc, w_proj = inputs
    _, h, pre = output
    ctx.save_for_backward(x, h, pre, w_fc, w_proj)
    ctx.mark_non_differentiable(h, pre)


def _backward(ctx, dy, _dh, _dpre):
    x, h, pre, w_fc, w_proj = ctx.saved_tensors
    return mlp_gelu_backward(dy.contiguous(), x, h, pre, w_fc, w_proj)


mlp_gelu.register_autograd(_backward, setup_context=_setup_context)


def mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    """c_proj(gelu_tanh(c_fc(x))) for bias-free linears; x [..., C] in the autocast dtype (bf16)."""
    dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    shape = x.shape
    y, _, _ = mlp_gelu(x.reshape(-1, shape[-1]).to(dt).contiguous(), w_fc.to(dt), w_proj.to(dt))
    return y.view(*shape[:-1], y.shape[-1])


class EpilogueMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.dropout(mlp(x, self.c_fc.weight, self.c_proj.weight))
        return super().forward(x)
