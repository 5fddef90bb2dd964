"""Why every cuBLASLt GEMM of the captured step comes with a 4-byte memset, and what it costs (issue 13).

    python -m bench.memset_probe            # one line per setting, run in a fresh process each

A CUDA graph of the step's GEMM shapes is captured and replayed under torch.profiler; per GEMM it counts the
memsets and the GPU's idle time, and times the replay. Settings that need a fresh process (environment
variables read when cuBLAS starts) run as subprocesses. The step's weight gradients with small outputs
(768 x 768) are not among SHAPES; bench/results/workspace-2026-11-28.md says why they matter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = [  # (M, K, N) of x[M, K] @ w[K, N], the 32-row step's (tokens 32768, C 768)
    (32768, 768, 2304),
    (32768, 768, 768),
    (32768, 768, 3072),
    (32768, 3072, 768),
    (2304, 32768, 768),  # a weight gradient: K is the tokens
    (768, 32768, 3072),
]


def probe(setting: str) -> dict:
    import torch

    if setting == "cublas":
        torch.backends.cuda.preferred_blas_library("cublas")
    dev = torch.device("cuda")
    ops = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        ops.append((a, b))
    reps = 4

    def body():
        return [torch.mm(a, b) for _ in range(reps) for a, b in ops]

    for _ in range(3):
        body()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    rewritten = None
    if (
        setting == "kernel-nodes"
    ):  # the step graph's rewrite (consumer/fast/memset_nodes.py), checked bit for bit
        from lmpipe.consumer.fast import memset_nodes

        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain, stream=s):
            want = body()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, stream=s):
            got = body()
        rewritten = memset_nodes.rewrite(g, dev)
        g.instantiate()
        plain.replay()
        g.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(want, got))
    else:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            body()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n_rep = 20
    for _ in range(n_rep):
        g.replay()
    torch.cuda.synchronize()
    replay_ms = 1e3 * (time.perf_counter() - t0) / n_rep
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        g.replay()
        torch.cuda.synchronize()
    ks = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    gemms = reps * len(ops)
    memsets = [e for e in ks if "Memset" in e.name or "memset" in e.name.lower()]
    busy = sum((e.time_range.end - e.time_range.start) for e in ks) / 1e3
    span = (ks[-1].time_range.end - ks[0].time_range.start) / 1e3 if ks else float("nan")
    names = sorted({e.name[:60] for e in ks if "Memset" not in e.name})
    return {
        "setting": setting,
        "memsets_per_gemm": len(memsets) / gemms,
        "replay_ms": round(replay_ms, 3),
        "busy_ms": round(busy, 3),
        "idle_us_per_gemm": round(1e3 * (span - busy) / gemms, 2),
        "kernels": names[:8],
        **({} if rewritten is None else {"memset_nodes_rewritten": rewritten, "outputs_equal": same}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.memset_probe: needs a CUDA GPU (scripts/gpu_check.sh runs on the device)")
    if args.one:
        print(json.dumps(probe(args.one)))
        return
    runs = [
        ("default", {}),
        ("cublas", {}),
        ("default", {"CUBLASLT_WORKSPACE_SIZE": "0"}),
        ("default", {"CUBLASLT_WORKSPACE_SIZE": "1024"}),
        ("default", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}),
        ("kernel-nodes", {}),  # the memset nodes as kernel nodes (consumer/fast/memset_nodes.py)
    ]
    for setting, env in runs:
        out = subprocess.run([sys.executable, "-m", "bench.memset_probe", "--one", setting],
                             env={**os.environ, **env}, capture_output=True, text=True)  # fmt: skip
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-300:]
        print(setting, env, line, flush=True)


if __name__ == "__main__":
    main()
