"""Probe: does timing cuBLASLt's algorithms beat the one its heuristic picks, on GPT-2's own GEMMs?

torch asks cuBLASLt's heuristic for one algorithm per GEMM and runs it. For the MLP's GELU epilogue GEMM the
heuristic's first pick was 7% slower than the best of its candidates timed (mlp_kernel.py autotunes for
that reason). This probe times each plain GEMM of a GPT-2 124M step as torch runs it, as nvmath-python runs it
with the heuristic's pick, and with the best of cuBLASLt's candidates timed (nvmath's autotune), and adds up
what a step would save. Forward and backward GEMMs are written as torch calls them (x @ W^T, dy @ W,
dy^T @ x). The MLP's two epilogue GEMMs (GELU_AUX after c_fc, DGELU in c_proj's input gradient) are timed
as consumer/fast/mlp_kernel.py calls them, their DGELU also with c_proj's weight copied K-major (a TN GEMM), and
the MLP's six GEMMs also in the other orientation (tokens-major: h, pre and dpre stored [4C, tokens]).
`--limits 8,64` times the best of each list of cuBLASLt's heuristic candidates (8 is nvmath's default).

    python -m bench.gemm_tune [--tokens 32768] [--dim 768] [--vocab 50304] [--limits 8,64] [--only dgelu ...]
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
    ap.add_argument(
        "--limits", default="8", help="lengths of cuBLASLt's candidate list to time, comma-separated"
    )
    ap.add_argument("--only", nargs="*", help="time only GEMMs whose name contains one of these words")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    quiet = logging.getLogger("gemm_tune.nvmath")
    quiet.setLevel(logging.WARNING)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, C, V, L = a.tokens, a.dim, a.vocab, a.layers

    def t(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.1

    # (name, A, B, calls per step[, epilogue, its input]): A @ B as the step's forward and backward issue them
    gemms: list[tuple] = []
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
    # the MLP's epilogue GEMMs on transposes, as consumer/fast/mlp_kernel.py writes them (cuBLASLt is column-major)
    x, w_fc, w_proj, dy, pre = t(N, C), t(4 * C, C), t(C, 4 * C), t(N, C), t(N, 4 * C)
    gemms += [
        ("c_fc forward, GELU_AUX epilogue", w_fc, x.T, L, MatmulEpilog.GELU_AUX, None),
        ("mlp.c_proj dx, DGELU epilogue", w_proj.T, dy.T, L, MatmulEpilog.DGELU, pre.T),
        (
            "mlp.c_proj dx, DGELU epilogue, W K-major",
            w_proj.t().contiguous(),
            dy.T,
            L,
            MatmulEpilog.DGELU,
            pre.T,
        ),
    ]
    # The other orientation: cuBLASLt writes an epilogue's result and its auxiliary column-major, so with the
    # tokens as its rows (x W^T, not W x^T) h, pre and dpre are stored [4C, tokens]; the plain GEMMs that
    # read them take them transposed
    h_t, pre_t, dpre_t = (t(4 * C, N).T for _ in range(3))  # [tokens, 4C] views of [4C, tokens] storage
    gemms += [
        ("c_fc forward, GELU_AUX epilogue, tokens-major", x, w_fc.T, L, MatmulEpilog.GELU_AUX, None),
        ("mlp.c_proj forward, h tokens-major", h_t, w_proj.T, L),
        ("mlp.c_proj dW, h tokens-major", dy.T, h_t, L),
        ("mlp.c_proj dx, DGELU epilogue, tokens-major", dy, w_proj, L, MatmulEpilog.DGELU, pre_t),
        ("c_fc dx, dpre tokens-major", dpre_t, w_fc, L),
        ("c_fc dW, dpre tokens-major", dpre_t.T, x, L),
    ]
    if a.only:
        gemms = [gm for gm in gemms if any(w.lower() in gm[0].lower() for w in a.only)]
    limits = [int(n) for n in a.limits.split(",")]
    stream = torch.cuda.current_stream()
    rows, saved = [], 0.0
    total_torch = 0.0
    as_run: dict[str, float] = {}
    for name, A, B, calls, *epi in gemms:
        epilog, aux = (epi + [None, None])[:2]
        inputs = None if aux is None else {"gelu_aux": aux}
        ref = _reference(A, B, epilog, aux)
        ms_torch = None if epilog else cuda_ms(lambda A=A, B=B: A @ B, a.iters)
        ms_heur, tuned, diff = None, [], 0.0
        for limit in limits:
            mm = Matmul(A, B, options={"blocking": "auto", "logger": quiet})
            mm.plan(preferences={"limit": limit}, epilog=epilog, epilog_inputs=inputs)
            n_found = len(mm.algorithms)
            if ms_heur is None:
                ms_heur = cuda_ms(lambda mm=mm: mm.execute(stream=stream), a.iters)
            mm.autotune(iterations=10)
            tuned.append((cuda_ms(lambda mm=mm: mm.execute(stream=stream), a.iters), n_found))
            out = mm.execute(stream=stream)
            out = out[0] if isinstance(out, tuple) else out
            diff = max(diff, ((out.float() - ref).abs().max() / ref.abs().max()).item())
            mm.free()
        flops = 2 * A.shape[0] * A.shape[1] * B.shape[1]
        ms_best = min(ms for ms, _ in tuned)
        as_run[name] = ms_best if ms_torch is None else ms_torch  # epilogues: nvmath's; plain GEMMs: torch's
        if ms_torch is not None and "tokens-major" not in name:
            saved += (ms_torch - min(ms_torch, ms_best)) * calls
            total_torch += ms_torch * calls
        rows.append([name, f"{A.shape[0]}x{A.shape[1]} @ {B.shape[0]}x{B.shape[1]}", calls,
                     "" if ms_torch is None else ms_torch, ms_heur,
                     *(f"{ms:.3f} ({n})" for ms, n in tuned), flops / ms_best / 1e9, f"{diff:.1e}"])  # fmt: skip
        print(
            f"{name}: torch {ms_torch}, heuristic {ms_heur:.3f}, tuned (ms, candidates) {tuned}", flush=True
        )
    body = (
        f"GPT-2 124M's GEMMs: {N:,} tokens, C = {C}, vocabulary {V:,}, {L} layers; bf16, mean of "
        f"{a.iters} calls after 3; 'best of N' is nvmath-python's autotune over cuBLASLt's first N heuristic "
        "candidates (10 runs each; in brackets how many it returned); the epilogue GEMMs have no torch "
        "counterpart; diff: max |nvmath - reference| / max |reference|, the reference in fp32.\n\n"
        + table(
            [
                "GEMM",
                "shape",
                "calls/step",
                "torch ms",
                "nvmath heuristic ms",
                *(f"best of {n} ms" for n in limits),
                "best TFLOP/s",
                "diff",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nThe plain GEMMs take {total_torch:.2f} ms a step as torch runs them; taking the faster of torch "
        f"and the best timed algorithm for each would save {saved:.2f} ms a step.\n"
    )
    mlp = {  # the MLP's six GEMMs a layer, in each orientation
        "as consumer/fast/mlp_kernel.py runs them": ["c_fc forward, GELU_AUX epilogue", "mlp.c_proj forward x W^T",
            "mlp.c_proj dW = dy^T x", "mlp.c_proj dx, DGELU epilogue", "c_fc dx = dy W", "c_fc dW = dy^T x"],
        "tokens-major": [n for n in as_run if n.endswith("tokens-major")],
    }  # fmt: skip
    for orientation, names in mlp.items():
        if len(names) == 6 and all(n in as_run for n in names):
            body += f"\nThe MLP's six GEMMs a layer, {orientation}: {sum(as_run[n] for n in names):.3f} ms.\n"
    print(body)
    write_result("gemm-tune", "cuBLASLt's heuristic pick against its best timed algorithm", body, a.out)


def _reference(A: torch.Tensor, B: torch.Tensor, epilog, aux: torch.Tensor | None) -> torch.Tensor:
    """A @ B in fp32, with the epilogue's GELU (tanh) or its gradient at aux applied."""
    z = A.float() @ B.float()
    if epilog is None:
        return z
    if aux is None:  # GELU_AUX: the result is gelu(z)
        return torch.nn.functional.gelu(z, approximate="tanh")
    pre = aux.float().requires_grad_(True)  # DGELU: z * gelu'(aux)
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(pre, approximate="tanh"), pre, z)
    return grad


if __name__ == "__main__":
    main()
