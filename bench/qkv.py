"""Probe: the q/k/v projection's backward, with and without the concatenation of dq, dk and dv.

Times, side by side on GPT-2 124M's shapes, a layer's projection backward as autograd writes it (dq, dk, dv
copied into one [tokens, 3C] gradient, then one GEMM for dx and one for dW) against consumer/fast/qkv_kernel.py's
(dx by its Triton GEMM reading the three in turn, dW by three cuBLAS GEMMs), and against dx as three cuBLAS
GEMMs accumulating in place.

    python -m bench.qkv [--tokens 32768] [--dim 768]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import cuda_ms, table, write_result
from lmpipe.consumer.fast import qkv_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n, C = a.tokens, a.dim
    g = torch.Generator(device="cuda").manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    dq, dk, dv, x, w = t(n, C), t(n, C), t(n, C), t(n, C), t(3 * C, C) * C**-0.5

    def autograds():
        d = torch.cat([dq, dk, dv], 1)
        return d @ w, d.T @ x

    def cat_only():
        return torch.cat([dq, dk, dv], 1)

    def kernel():
        return qkv_kernel.qkv_backward(dq, dk, dv, x, w)

    def dx_kernel():
        return qkv_kernel.input_grad(dq, dk, dv, w)

    def dx_addmm():
        dx = dq @ w[:C]
        dx.addmm_(dk, w[C : 2 * C])
        return dx.addmm_(dv, w[2 * C :])

    def dx_torch():
        return torch.cat([dq, dk, dv], 1) @ w

    want = autograds()
    got = kernel()
    err = max(float((p.float() - q.float()).abs().max() / q.float().abs().max()) for p, q in zip(got, want))
    ways = [
        ("autograd's: concatenate, then dx and dW GEMMs", autograds),
        ("consumer/fast/qkv_kernel.py: Triton dx, three dW GEMMs", kernel),
        ("the concatenation alone", cat_only),
        ("dx: concatenate + cuBLAS GEMM", dx_torch),
        ("dx: the Triton kernel", dx_kernel),
        ("dx: three cuBLAS GEMMs accumulating in place", dx_addmm),
    ]
    rows = []
    for _ in range(2):  # two interleaved rounds: the spread shows
        for name, fn in ways:
            ms = cuda_ms(fn, a.iters, warmup=5)
            rows.append([name, ms, ms * a.layers])
    body = (
        f"{n:,} tokens, C={C}, bf16, {a.iters} timed calls a way, two interleaved rounds; Triton tile picked: "
        f"{qkv_kernel._dx.best_config}; largest difference from autograd's (relative to its largest value): "
        f"{err:.2e}.\n\n" + table(["way", "ms a layer", f"ms a step ({a.layers} layers)"], rows)
    )
    print(body)
    write_result(
        "qkv", "The q/k/v projection's backward, with and without concatenating dq, dk, dv", body, a.out
    )


if __name__ == "__main__":
    main()
