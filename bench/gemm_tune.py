"""Probe: does timing cuBLASLt's algorithms beat the one its heuristic picks, on GPT-2's own GEMMs?

torch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. For the MLP's GELU epilogue GEMM the
heuristic's first pick was 7% slower than the best of its candidates timed (mlp_kernel.py autotunes for
that reason). This probe times each plain GEMM of a GPT-2 124M step as torch runs it, as nvmath-python runs it
with the heuristic's pick, and with the best of cuBLASLt's candidates timed (nvmath's autotune), and adds up
what a step would save. Forward and backward GEMMs are written as torch calls them (x @ W^T, dy @ W,
dy^T @ x); the MLP's c_fc forward and its dh GEMM are the epilogue GEMMs already tuned.

    python -m bench.gemm_tune [--tokens 32768] [--dim 768] [--vocab 50304]
"""

from __future__ import annotations

import argparse
import logging

import torch

from bench.common import cuda_ms, table, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from nvmath.linalg.advanced import Matmul

    quiet = logging.getLogger("gemm_tune.nvmath")
    quiet.setLevel(logging.WARNING)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, C, V, L = a.tokens, a.dim, a.vocab, a.layers

    def t(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.1

    # (name, A, B, calls per step): A @ B as the step's forward and backward issue them
    gemms = []
    for lin, fan_in, fan_out, parts in (
        ("c_attn", C, 3 * C, "fwd dx dW"),
        ("attn.c_proj", C, C, "fwd dx dW"),
        ("mlp.c_proj", 4 * C, C, "fwd dW"),  # its dx is the DGELU epilogue GEMM
        ("c_fc", C, 4 * C, "dx dW"),  # its forward is the GELU_AUX epilogue GEMM
    ):
        x, w, dy = t(N, fan_in), t(fan_out, fan_in), t(N, fan_out)
        if "fwd" in parts:
            gemms.append((f"{lin} forward x W^T", x, w.T, L))
        if "dx" in parts:
            gemms.append((f"{lin} dx = dy W", dy, w, L))
        if "dW" in parts:
            gemms.append((f"{lin} dW = dy^T x", dy.T, x, L))
    h, w, dl = t(N, C), t(V, C), t(N, V)
    gemms += [
        ("lm_head forward h W^T", h, w.T, 1),
        ("lm_head dh = dlogits W", dl, w, 1),
        ("lm_head dW = dlogits^T h", dl.T, h, 1),
    ]
    stream = torch.cuda.current_stream()
    rows, saved = [], 0.0
    total_torch = 0.0
    for name, A, B, calls in gemms:
        ms_torch = cuda_ms(lambda A=A, B=B: A @ B, a.iters)
        mm = Matmul(A, B, options={"blocking": "auto", "logger": quiet})
        mm.plan()
        ms_heur = cuda_ms(lambda mm=mm: mm.execute(stream=stream), a.iters)
        mm.autotune(iterations=10)
        ms_tuned = cuda_ms(lambda mm=mm: mm.execute(stream=stream), a.iters)
        ref = (A @ B).float()
        diff = ((mm.execute(stream=stream).float() - ref).abs().max() / ref.abs().max()).item()
        mm.free()
        flops = 2 * A.shape[0] * A.shape[1] * B.shape[1]
        best = min(ms_torch, ms_tuned)
        saved += (ms_torch - best) * calls
        total_torch += ms_torch * calls
        rows.append([name, f"{A.shape[0]}x{A.shape[1]} @ {B.shape[0]}x{B.shape[1]}", calls, ms_torch,
                     ms_heur, ms_tuned, ms_torch / ms_tuned, flops / ms_tuned / 1e9, f"{diff:.1e}"])  # fmt: skip
        print(
            f"{name}: torch {ms_torch:.3f} ms, nvmath heuristic {ms_heur:.3f}, tuned {ms_tuned:.3f}",
            flush=True,
        )
    body = (
        f"GPT-2 124M's plain GEMMs: {N:,} tokens, C = {C}, vocabulary {V:,}, {L} layers; bf16, mean of "
        f"{a.iters} calls after 3; 'tuned' is nvmath-python's autotune (cuBLASLt's candidates, 10 runs "
        "each); diff: max |tuned - torch| / max |torch|.\n\n"
        + table(
            [
                "GEMM",
                "shape",
                "calls/step",
                "torch ms",
                "nvmath heuristic ms",
                "tuned ms",
                "torch / tuned",
                "tuned TFLOP/s",
                "diff",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nThese GEMMs take {total_torch:.2f} ms a step as torch runs them; taking the faster of torch "
        f"and the tuned algorithm for each would save {saved:.2f} ms a step.\n"
    )
    print(body)
    write_result("gemm-tune", "cuBLASLt's heuristic pick against its best timed algorithm", body, a.out)


if __name__ == "__main__":
    main()
