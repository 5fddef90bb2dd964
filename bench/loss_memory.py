"""Peak memory of the loss: plain cross-entropy on full logits vs liger's fused linear cross-entropy.

    python -m bench.loss_memory                  # vocab 50304, 32k tokens per step, dim 768, bf16

Forward and backward of lm_head + cross-entropy alone, from the final hidden states, the way GPT.forward
computes them. Peak memory is measured above what the inputs already hold. Writes
bench/results/loss-memory-<date>.md.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import table, write_result
from lmpipe.consumer.fast.liger import _fused_ce, fused_linear_cross_entropy
from lmpipe.consumer.model import IGNORE


def measure(fused: bool, tokens: int, dim: int, vocab: int, repeats: int = 5) -> tuple[float, float, float]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(vocab, dim, device=dev) * 0.02)
    h = torch.randn(tokens, dim, device=dev, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=dev)
    targets[::17] = IGNORE
    loss_fn = fused_linear_cross_entropy() if fused else None
    torch.cuda.synchronize()
    times, peaks, value = [], [], 0.0
    for _ in range(repeats):
        weight.grad = h.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                loss = _fused_ce(loss_fn, weight.to(torch.bfloat16), h.to(torch.bfloat16), targets)
            else:
                logits = h @ weight.t()
                loss = torch.nn.functional.cross_entropy(
                    logits.float(), targets, ignore_index=IGNORE, reduction="sum"
                )
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        value = float(loss)
    return max(peaks), sorted(times)[len(times) // 2], value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if fused_linear_cross_entropy() is None:
        raise SystemExit("liger-kernel is not installed (pip install 'lmpipe[fused]')")
    plain = measure(False, args.tokens, args.dim, args.vocab)
    fused = measure(True, args.tokens, args.dim, args.vocab)
    rows = [
        ["plain (logits + cross_entropy)", plain[0], 1.0, plain[1], plain[2]],
        ["fused linear cross-entropy (liger)", fused[0], fused[0] / plain[0], fused[1], fused[2]],
    ]
    body = (
        f"lm_head + loss alone, forward and backward, bf16 autocast: {args.tokens:,} tokens, dim {args.dim}, "
        f"vocab {args.vocab}. Peak: GPU memory above the inputs; time: median of 5.\n\n"
        + table(["loss", "peak GiB", "vs plain", "ms", "loss value (sum)"], rows)
    )
    print(body)
    write_result("loss-memory", "Fused linear cross-entropy: memory", body, args.out)


if __name__ == "__main__":
    main()
