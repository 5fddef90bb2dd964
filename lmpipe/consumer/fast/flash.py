"""Document-causal attention with FlashAttention-4's variable-length kernels (`--attention flash`).

A packed row is several documents; FlexAttention walks 128 x 128 tiles of each row's causal triangle and
masks what crosses a document, so a row of short documents still pays for many half-masked tiles.
FlashAttention's varlen kernels take the documents themselves (`cu_seqlens`: where each one starts in the
flattened batch) and compute only each document's own triangle. FlashAttention-4 (`flash-attn-4`, CuTe DSL)
has them for Hopper and Blackwell, forward and backward; it is an optional extra (`lmpipe[flash]`).

The kernels are wrapped as torch custom ops so that torch.compile treats each call as one opaque node
instead of tracing the CuTe DSL's Python (flash-attn-4 registers none of its own).

Shapes are fixed for torch.compile: `cu_seqlens` is padded to a bucket (inputs.cu_seqlens_host) and
`max_seqlen` is the row length, so a compiled model recompiles at most once per bucket.

Chosen by `--attention flash` (it changes what the inputs carry), not by `--fast`; build() applies it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from lmpipe.consumer.fast import mix
from lmpipe.consumer.model import AttnSpec, CausalSelfAttention

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built


def problem(device: torch.device) -> str | None:
    """Why `--attention flash` cannot run on `device`, or None if it can."""
    if device.type != "cuda":
        return f"--attention flash needs a CUDA GPU; this run is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"--attention flash needs a Hopper or newer GPU (sm90+); this one is sm{major}{minor}"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "--attention flash needs FlashAttention-4: pip install 'lmpipe[flash]' (flash-attn-4)"
    return None


@torch.library.custom_op("lmpipe::flash_varlen_fwd", mutates_args=(), device_types="cuda")
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        softmax_scale=scale, causal=True, return_lse=True,
    )  # fmt: skip
    return out, lse


@_fwd.register_fake
def _(q, k, v, cu, max_len, scale):
    # lse of varlen inputs is [heads, total tokens], in fp32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("lmpipe::flash_varlen_bwd", mutates_args=(), device_types="cuda")
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q, k, v, out, dout.contiguous(), lse, scale, True,
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
    )[:3]  # fmt: skip
    return dq, dk, dv


@_bwd.register_fake
def _(dout, q, k, v, out, lse, cu, max_len, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu, max_len, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_len, ctx.scale = max_len, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """q, k, v: [B, L, H, D] (the last dimension contiguous) -> [B, L, H, D], causal within each
    document piece that `cu` (cu_seqlens_host, on the GPU) marks."""
    B, L, H, D = q.shape
    flat = [t.reshape(B * L, H, D) for t in (q, k, v)]
    out, _ = _fwd(*flat, cu, L, D**-0.5)
    return out.view(B, L, H, D)


class FlashAttention(CausalSelfAttention):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttnSpec) -> torch.Tensor:
        if attn.kind == "varlen":  # takes [B, L, H, D] as it is (no attention dropout)
            assert attn.cu_seqlens is not None
            return varlen_attention(q, k, v, attn.cu_seqlens)
        return super().attend(q, k, v, attn)


def unavailable(built: Built) -> str | None:
    return problem(built.device)


def apply(built: Built) -> None:
    for module in built.model.modules():
        if isinstance(module, CausalSelfAttention):
            mix(module, FlashAttention)
