"""The LM head's loss alone: torch's cross-entropy (compiled) against the one-pass kernel (consumer/loss.py).

    python -m bench.loss                         # GPT-2 124M's head: 32 x 1024 tokens, 768 -> 26,624

GPU time of forward + backward of `lm_head` and the summed cross-entropy, bf16, CUDA events over --steps
repetitions after a warm-up; each kernel setting of the one-pass kernel (--blocks, --warps) side by side.
Writes bench/results/loss-<date>.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import table, write_result
from lmpipe.consumer import loss as L
from lmpipe.consumer.model import IGNORE


def timed(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32 * 1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=26624)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--blocks", default="2048,4096,8192,16384,32768")
    p.add_argument("--warps", default="8,16,32")
    p.add_argument("--out", default=None)
    a = p.parse_args()
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

    base = timed(run(torch_loss), a.steps)
    rows = [["torch.compile cross-entropy", "", "", base, 1.0]]
    print(f"torch: {base:.3f} ms", flush=True)
    for block in map(int, a.blocks.split(",")):
        for warps in map(int, a.warps.split(",")):
            L.BLOCK, L.WARPS = block, warps
            ms = timed(run(lambda h, w, t: L._HeadLoss.apply(h, w, t, IGNORE)), a.steps)
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
