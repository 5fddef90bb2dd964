"""The LM head's loss alone: torch's cross-entropy (compiled) against the one-pass kernel (consumer/fast/loss.py).

    python -m bench.loss                         # GPT-2 124M's head: 32 x 1024 tokens, 768 -> 26,624

GPU time of forward + backward of `lm_head` and the summed cross-entropy, bf16, CUDA events over --steps
repetitions after a warm-up; each kernel setting of the one-pass kernel (--blocks, --warps) side by side.
Writes bench/results/loss-<date>.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.common import cuda_ms, table, write_result
from lmpipe.consumer.fast import loss as L
from lmpipe.consumer.model import IGNORE

# --- --ce-only: variants of the per-row kernel alone, on a [tokens, vocab] logits buffer -----------------
# Each reads a row, writes its loss and overwrites the row with softmax - one-hot, as L._ce_rows does.


@triton.jit
def _ce_rows_whole(logits, stride, targets, losses, vocab, ignore, BLOCK: tl.constexpr):
    """A row read once: all of it held in registers (BLOCK >= vocab) between its log-sum-exp and gradient."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    target = tl.load(targets + row)
    valid = target != ignore
    cols = tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), 0))
    picked = tl.sum(tl.where(cols == target, x, 0.0), 0)
    tl.store(losses + row, tl.where(valid, lse - picked, 0.0))
    g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
    tl.store(base + cols, tl.where(valid, g, 0.0).to(logits.dtype.element_ty), mask=cols < vocab)


@triton.jit
def _ce_rows_strided(
    logits,
    stride,
    targets,
    losses,
    rows,
    vocab,
    ignore,
    BLOCK: tl.constexpr,
    HINTS: tl.constexpr = True,
    FROM_END: tl.constexpr = True,
):
    """_ce_row for every num_programs-th row from program_id: a grid of a few programs an SM keeps fewer rows
    in flight than one program a row, so more of each row is still in L2 when its second pass reads it."""
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        L._ce_row(
            logits + row * stride, tl.load(targets + row), losses + row, vocab, ignore, BLOCK, HINTS, FROM_END
        )


def ce_only(a) -> None:
    """Time the per-row kernel variants alone; check each against L._ce_rows on the same logits."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    N, V = a.tokens, a.vocab
    fresh = (3 * torch.randn(N, V, device=dev)).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev)
    t[::7] = IGNORE

    def launch(block, warps, hints=True, from_end=True):
        return lambda x, out: L._ce_rows[(N,)](
            x, x.stride(0), t, out, V, IGNORE, BLOCK=block, HINTS=hints, FROM_END=from_end, num_warps=warps
        )

    variants = {
        f"shipped: cache hints, second pass from the end (BLOCK {L.BLOCK}, {L.WARPS} warps)": launch(
            L.BLOCK, L.WARPS
        ),
        f"cache hints, second pass in order (BLOCK {L.BLOCK}, {L.WARPS} warps)": launch(
            L.BLOCK, L.WARPS, from_end=False
        ),
        f"neither (the kernel before; BLOCK {L.BLOCK}, {L.WARPS} warps)": launch(
            L.BLOCK, L.WARPS, hints=False, from_end=False
        ),
        "shipped, BLOCK 4096, 8 warps": launch(4096, 8),
        "shipped, BLOCK 8192, 4 warps": launch(8192, 4),
        "shipped, BLOCK 16384, 16 warps": launch(16384, 16),
    }
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for per_sm, warps in ((1, 16), (2, 8), (2, 16), (4, 8), (4, 16), (8, 8)):  # at most 64 warps an SM
        variants[f"strided: {per_sm} programs an SM, BLOCK {L.BLOCK}, {warps} warps"] = (
            lambda x, out, g=per_sm * sms, w=warps: _ce_rows_strided[(g,)](
                x, x.stride(0), t, out, N, V, IGNORE, BLOCK=L.BLOCK, num_warps=w
            )
        )
    whole = triton.next_power_of_2(V)
    for warps in (16, 32):
        variants[f"one read: the row in registers (BLOCK {whole}, {warps} warps)"] = lambda x, out, w=warps: (
            _ce_rows_whole[(N,)](x, x.stride(0), t, out, V, IGNORE, BLOCK=whole, num_warps=w)
        )
    ref_x, ref_loss = fresh.clone(), torch.empty(N, device=dev)
    next(iter(variants.values()))(ref_x, ref_loss)
    tbps = 4.8 if "H200" in torch.cuda.get_device_name() else 3.35  # memory bandwidth: H200, else an H100's
    floor_ms = 2 * N * V * 2 / (tbps * 1e12) * 1e3  # one read and one write of the logits
    rows = []
    for name, fn in variants.items():
        x, out = fresh.clone(), torch.empty(N, device=dev)
        try:
            fn(x, out)
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not compile (registers) is a row, not the end
            rows.append([name, f"failed: {type(e).__name__}", "", "", ""])
            print(name, "failed:", str(e).splitlines()[0][:200], flush=True)
            continue
        dl = (out - ref_loss).abs().max().item()
        dg = (x.float() - ref_x.float()).abs().max().item()
        ms = cuda_ms(lambda fn=fn, x=x, out=out: fn(x, out), a.steps)
        rows.append([name, ms, floor_ms / ms, dl, dg])
        print(f"{name}: {ms:.3f} ms (loss diff {dl:.2e}, grad diff {dg:.2e})", flush=True)
    # the head's backward scales its two small operands by the upstream gradient (a 0-dim fp32 tensor)
    h, w = torch.randn(N, a.dim, device=dev).bfloat16(), torch.randn(V, a.dim, device=dev).bfloat16()
    grad = torch.tensor(1.0 / 3, device=dev)
    two = cuda_ms(lambda: (w * grad, h * grad), a.steps)
    fused = cuda_ms(lambda: torch._foreach_mul([w, h], grad), a.steps)
    ours = cuda_ms(lambda: (L._times(w, grad), L._times(h, grad)), a.steps)
    # what each computes: the fp32 product rounded once, or the product with the scale rounded to bf16 first
    exact = all(torch.equal(L._times(x, grad), (x.float() * grad).bfloat16()) for x in (w, h))
    torchs = all(torch.equal(x * grad, (x.float() * grad.bfloat16().float()).bfloat16()) for x in (w, h))
    print(
        f"scale the head's operands: two muls {two:.3f} ms, one _foreach_mul {fused:.3f} ms, "
        f"the Triton scale {ours:.3f} ms; Triton's is the fp32 product rounded once: {exact}; torch's rounds "
        f"the scale to bf16 first: {torchs}"
    )
    body = (
        f"The per-row loss kernel alone over [{N:,} x {V:,}] bf16 logits, in place, mean of {a.steps} "
        f"calls after 3; 'floor' is one read and one write at {tbps} TB/s ({floor_ms:.2f} ms); diffs are "
        "against the shipped kernel's loss and gradient.\n\n"
        + table(["kernel", "ms", "floor / ms", "max loss diff", "max grad diff"], rows)
        + f"\n\nThe head's backward scaling w and h by the upstream gradient: two multiplications {two:.3f} ms, "
        f"one torch._foreach_mul {fused:.3f} ms, the Triton scale (L._times) {ours:.3f} ms. The Triton scale "
        f"is the fp32 product rounded once: {exact}; torch's multiplication rounds the scale to bf16 first: "
        f"{torchs}.\n"
    )
    print(body)
    write_result("loss-kernel-variants", "The loss kernel's variants alone", body, a.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32 * 1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=26624)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--blocks", default="2048,4096,8192,16384,32768")
    p.add_argument("--warps", default="8,16,32")
    p.add_argument("--out", default=None)
    p.add_argument("--ce-only", action="store_true", help="time the per-row kernel's variants alone")
    a = p.parse_args()
    if a.ce_only:
        return ce_only(a)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(a.vocab, a.dim, device=dev)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, a.vocab, (a.tokens,), device=dev)

    @torch.compile
    def torch_loss(h, w, t):
        return F.cross_entropy((h @ w.t()).float(), t, ignore_index=IGNORE, reduction="sum")

    def run(loss_fn):
        def step():
            h.grad = w.grad = None
            loss_fn(h, w, t).backward()

        return step

    base = cuda_ms(run(torch_loss), a.steps)
    rows = [["torch.compile cross-entropy", "", "", base, 1.0]]
    print(f"torch: {base:.3f} ms", flush=True)
    for block in map(int, a.blocks.split(",")):
        for warps in map(int, a.warps.split(",")):
            L.BLOCK, L.WARPS = block, warps
            ms = cuda_ms(run(lambda h, w, t: L._HeadLoss.apply(h, w, t, IGNORE, False)), a.steps)
            rows.append(["one-pass kernel", block, warps, ms, base / ms])
            print(f"kernel BLOCK={block} warps={warps}: {ms:.3f} ms", flush=True)
    body = (
        f"lm_head [{a.vocab} x {a.dim}] over {a.tokens:,} tokens, bf16, forward + backward (both matmuls "
        f"included), mean of {a.steps} after a warm-up.\n\n"
        + table(["loss", "BLOCK", "warps", "ms", "speed-up"], rows)
    )
    print(body)
    write_result("loss", "The LM head's loss: torch against the one-pass kernel", body, a.out)


if __name__ == "__main__":
    main()
