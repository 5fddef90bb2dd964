"""Path loss-kernel: the LM head and its cross-entropy with one pass over the logits (CUDA, Triton).

torch.compile's cross-entropy reads the [tokens, vocab] logits twice a step: in the forward pass (an online
softmax) and in the backward pass (the softmax again, minus the one-hot), and writes their gradient. Here one
kernel, in the forward pass, takes each row's log-sum-exp and, while
the row is still in cache, overwrites the logits with their gradient (softmax - one-hot). The backward pass
is then two matmuls and a scale: the upstream gradient is one scalar, so it multiplies the matmuls' small
outputs, not the logits. This is liger-kernel's cross-entropy idea without its chunking, which needs a host
sync a step (`--fused-ce`). 1.016-1.020x tokens/s on GPT-2 124M at 32 rows on an H100
(bench/results/ablation-h100-2026-11-26.md). In fp16 torch's runs: softmax - one-hot, kept unscaled by the
loss scale, would underflow there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lmpipe.consumer.fast import cublaslt, mix
from lmpipe.consumer.fast.liger import LigerLoss, head_inputs
from lmpipe.consumer.model import GPT, IGNORE

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

BLOCK = 8192  # vocabulary entries a program reads at a time (bench.loss: best of 2k-32k x 8-32 warps)
WARPS = 8


@triton.jit
def _ce_row(
    base, target, loss, vocab, ignore, BLOCK: tl.constexpr, HINTS: tl.constexpr, FROM_END: tl.constexpr
):
    """One row at `base`: loss = logsumexp(x) - x[target] (0 where target == ignore); x := softmax(x) - one-hot
    (0 where ignored), in place. The row is read twice; the first pass asks L2 to keep it (evict_last), the
    second runs from the row's end, so the blocks read last come back first, and lets it go (evict_first).
    Over GPT-2's 32k x 50k logits on an H100: 2.78 ms, against 3.30 ms with neither (HINTS, FROM_END:
    bench.loss --ce-only, bench/results/head-h100-2026-11-27.md)."""
    valid = target != ignore
    m = float("-inf")
    s = 0.0
    for off in range(0, vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        if HINTS:
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"), eviction_policy="evict_last")
        else:
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    picked = tl.load(base + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss, tl.where(valid, lse - picked, 0.0))
    last = tl.cdiv(vocab, BLOCK) - 1
    for i in range(0, last + 1):
        if FROM_END:
            cols = (last - i) * BLOCK + tl.arange(0, BLOCK)
        else:
            cols = i * BLOCK + tl.arange(0, BLOCK)
        if HINTS:
            x = tl.load(base + cols, mask=cols < vocab, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(base + cols, mask=cols < vocab, other=0.0)
        g = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == target, 1.0, 0.0)
        g = tl.where(valid, g, 0.0).to(base.dtype.element_ty)
        if HINTS:
            tl.store(base + cols, g, mask=cols < vocab, eviction_policy="evict_first")
        else:
            tl.store(base + cols, g, mask=cols < vocab)


@triton.jit
def _ce_rows(
    logits,
    stride,
    targets,
    losses,
    vocab,
    ignore,
    BLOCK: tl.constexpr,
    HINTS: tl.constexpr = True,
    FROM_END: tl.constexpr = True,
):
    """_ce_row for row program_id (a program a row)."""
    row = tl.program_id(0).to(tl.int64)
    _ce_row(
        logits + row * stride, tl.load(targets + row), losses + row, vocab, ignore, BLOCK, HINTS, FROM_END
    )


@triton.jit
def _scaled(src, dst, scale, n, BLOCK: tl.constexpr):
    """dst := src * scale[0], the product in fp32 rounded once. torch's src * scale, a bf16 tensor times an
    fp32 0-dim CUDA tensor, runs an unvectorized casting loop: 0.23 ms against this kernel's 0.09 ms for the
    head's two operands (GPT-2 124M, 32 rows, H100; bench.loss --ce-only), and its result is not the fp32
    product rounded once (bench.loss prints which it is)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    s = tl.load(scale).to(tl.float32)
    x = tl.load(src + offs, mask=keep).to(tl.float32)
    tl.store(dst + offs, (x * s).to(dst.dtype.element_ty), mask=keep)


def _times(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if not (t.is_contiguous() and scale.numel() == 1):
        return t * scale
    out = torch.empty_like(t)
    _scaled[(triton.cdiv(t.numel(), 4096),)](t, out, scale, t.numel(), BLOCK=4096, num_warps=4)
    return out


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore: int, tuned_gemm: bool
    ) -> torch.Tensor:
        tuned = tuned_gemm and h.is_cuda and h.dtype == torch.bfloat16 and not cublaslt.nvmath_missing()
        logits = cublaslt.gemm(h, w.t()) if tuned else h @ w.t()
        losses = torch.empty(logits.size(0), device=logits.device, dtype=torch.float32)
        _ce_rows[(logits.size(0),)](
            logits, logits.stride(0), targets, losses, logits.size(1), ignore, BLOCK=BLOCK, num_warps=WARPS
        )
        ctx.save_for_backward(h, w, logits)  # logits now hold d(loss)/d(logits)
        ctx.tuned = tuned
        return losses.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w, dlogits = ctx.saved_tensors
        # The scalar scales the small operands, not the logits-sized one: each product is then rounded to
        # bf16 once, as torch's (grad * (softmax - one-hot)) @ w is; scaling the products after rounding
        # them doubles their rounding error.
        ws, hs = _times(w, grad), _times(h, grad)
        # only dW's GEMM is tuned: dh's timed algorithm is slower than torch's pick (bench.gemm_tune). nvmath's
        # result takes its first operand's layout: dW^T = hs^T dlogits comes out column-major, so dW is
        # row-major as w is, and autograd copies nothing into w's layout
        dw = cublaslt.gemm(hs.t(), dlogits).t() if ctx.tuned else dlogits.t() @ hs
        return dlogits @ ws, dw, None, None, None


@torch.compiler.disable  # an opaque kernel for dynamo: the compiled model ends at the final layer norm
def head_loss(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, ignore: int, tuned_gemm: bool = False
) -> torch.Tensor:
    """sum over rows with targets != ignore of cross_entropy(h @ w.T, targets): h [N, C], w [V, C], targets
    [N] (int64), h and w of one dtype (the matmul's). The logits' gradient is made now and kept in their
    place, so memory is what keeping the logits for backward takes. `tuned_gemm`: the head's GEMMs through
    cublaslt.gemm in bf16 (path head-gemm)."""
    return _HeadLoss.apply(h.contiguous(), w, targets.contiguous(), ignore, tuned_gemm)


class KernelLoss(GPT):
    tuned_head_gemm = False  # head_gemm.TunedHead sets it

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not h.is_cuda:
            return super().loss(h, targets)
        h, w, t = head_inputs(self, h, targets)
        return head_loss(h, w, t, IGNORE, self.tuned_head_gemm)


def unavailable(built: Built) -> str | None:
    if built.precision == "fp16":
        return "in fp16 its unscaled softmax - one-hot would underflow"
    if isinstance(built.model, LigerLoss):
        return "--fused-ce (liger) computes the head's loss"
    return None


def apply(built: Built) -> None:
    mix(built.model, KernelLoss)
