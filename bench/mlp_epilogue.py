"""Probe: GPT-2's MLP with cuBLASLt's GELU epilogues (nvmath-python) against the compiled PyTorch MLP.

Forward: pre = x W1^T + b1 and gelu(pre) come out of one GEMM (GELU_AUX_BIAS: the GEMM writes gelu(pre) and
keeps pre as its auxiliary output). Backward: dpre = (dy W2) * gelu'(pre) and db1 = sum(dpre) come out of one
GEMM (DGELU_BGRAD). Inductor instead runs the GELU and its gradient as separate memory-bound kernels.

    python -m bench.mlp_epilogue [--rows 32] [--seq 1024] [--dim 768]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    import nvmath
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    dev = torch.device("cuda")
    n, c = args.rows * args.seq, args.dim
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, c, device=dev, dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(4 * c, c, device=dev, generator=g) * 0.02).bfloat16()
    b1 = (torch.randn(4 * c, device=dev, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(c, 4 * c, device=dev, generator=g) * 0.02).bfloat16()
    b2 = (torch.randn(c, device=dev, generator=g) * 0.02).bfloat16()
    dy = torch.randn(n, c, device=dev, dtype=torch.bfloat16, generator=g)
    print("nvmath", nvmath.__version__, "| torch", torch.__version__, "|", torch.cuda.get_device_name())

    # --- the compiled reference: what the model runs today
    def mlp(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    ref = torch.compile(mlp, dynamic=False)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]

    def run_ref():
        out = ref(*leaves)
        return torch.autograd.grad(out, leaves, dy)

    # --- the epilogue path: cuBLASLt is column-major, so the GEMMs are written on the transposes:
    # pre^T [4c, n] = W1 [4c, c] @ x^T [c, n], bias along its rows (length 4c); its column-major result is
    # pre [n, 4c] row-major, so .T of it is the contiguous activation the next GEMM reads.
    stream = torch.cuda.current_stream()
    t0 = time.perf_counter()
    fwd = Matmul(w1, x.T, options={"blocking": "auto"})
    fwd.plan(epilog=MatmulEpilog.GELU_AUX_BIAS, epilog_inputs={"bias": b1})
    hT, aux = fwd.execute(stream=stream)
    print(
        f"fwd plan {time.perf_counter() - t0:.3f}s; result {tuple(hT.shape)} strides {hT.stride()}; "
        f"aux {list(aux)} {tuple(aux['gelu_aux'].shape)} strides {aux['gelu_aux'].stride()} {aux['gelu_aux'].dtype}"
    )
    bwd = Matmul(w2.T, dy.T, options={"blocking": "auto"})
    bwd.plan(epilog=MatmulEpilog.DGELU_BGRAD, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
    dpreT, baux = bwd.execute(stream=stream)
    print(
        f"bwd result {tuple(dpreT.shape)} strides {dpreT.stride()}; aux {list(baux)} "
        f"{[tuple(v.shape) for v in baux.values()]}"
    )

    def run_epi():
        fwd.reset_operands_unchecked(a=leaves[1].detach(), b=x.T, epilog_inputs={"bias": b1})
        hT, aux = fwd.execute(stream=stream)
        h = hT.T  # [n, 4c], contiguous
        out = F.linear(h, w2, b2)
        # backward
        dw2 = dy.T @ h
        db2 = dy.sum(0)
        bwd.reset_operands_unchecked(a=w2.T, b=dy.T, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
        dpreT, baux = bwd.execute(stream=stream)
        dpre = dpreT.T  # [n, 4c]
        db1 = baux["dgelu_bgrad"].reshape(-1)
        dw1 = dpre.T @ x
        dx = dpre @ w1
        return out, (dx, dw1, db1, dw2, db2)

    # correctness against fp32 autograd
    lf = [t.float().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    outf = mlp(*lf)
    gf = torch.autograd.grad(outf, lf, dy.float())
    out_e, ge = run_epi()
    gr = run_ref()
    names = ["dx", "dw1", "db1", "dw2", "db2"]
    print(
        "max |err| / max |ref| vs fp32:  out  epi %.2e"
        % ((out_e.float() - outf).abs().max() / outf.abs().max())
    )
    for nm, a, b, f in zip(names, ge, gr, gf):
        s = f.abs().max()
        print(
            f"  {nm}: epilogue {((a.float() - f).abs().max() / s):.2e}  compiled {((b.float() - f).abs().max() / s):.2e}"
        )

    def bench(fn, label):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        s.record()
        for _ in range(args.iters):
            fn()
        e.record()
        host = (time.perf_counter() - h0) / args.iters
        torch.cuda.synchronize()
        ms = s.elapsed_time(e) / args.iters
        print(f"{label:<44} {ms:7.3f} ms (host {host * 1e3:.3f} ms)")
        return ms

    # single GEMMs: the plain one torch runs against the one with the epilogue
    bench(lambda: F.linear(x, w1, b1), "fwd GEMM: F.linear(x, W1, b1)")
    bench(lambda: fwd.execute(stream=stream), "fwd GEMM: GELU_AUX_BIAS epilogue")
    bench(lambda: dy @ w2, "bwd GEMM: dy @ W2")
    bench(lambda: bwd.execute(stream=stream), "bwd GEMM: DGELU_BGRAD epilogue")
    bwd2 = Matmul(w2.T, dy.T, options={"blocking": "auto"})
    bwd2.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
    bench(lambda: bwd2.execute(stream=stream), "bwd GEMM: DGELU epilogue")
    bwd2.autotune(iterations=5)
    bench(lambda: bwd2.execute(stream=stream), "bwd GEMM: DGELU epilogue, autotuned")
    bwd.autotune(iterations=5)
    bench(lambda: bwd.execute(stream=stream), "bwd GEMM: DGELU_BGRAD epilogue, autotuned")
    fwd.autotune(iterations=5)
    bench(lambda: fwd.execute(stream=stream), "fwd GEMM: GELU_AUX_BIAS epilogue, autotuned")
    print("algorithms tried by plan:", len(bwd.algorithms) if hasattr(bwd, "algorithms") else "?")
    pre = F.linear(x, w1, b1)
    gelu_c = torch.compile(lambda p: F.gelu(p, approximate="tanh"))
    bench(lambda: gelu_c(pre), "gelu forward (compiled)")
    r = bench(run_ref, "MLP fwd+bwd, compiled (today)")
    e = bench(run_epi, "MLP fwd+bwd, cuBLASLt epilogues (eager)")
    print(f"epilogue / compiled time: {e / r:.3f}; saving per layer {r - e:.3f} ms")


if __name__ == "__main__":
    main()
