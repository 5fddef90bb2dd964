"""Where a training step's GPU time goes, by kind of kernel (issue: MFU on GPT-2 124M).

    python -m bench.kernels                      # GPT-2 124M, T=1024, 32 rows, bf16, compile, synthetic-fed

torch.profiler over `--steps` synthetic-fed steps after `--warmup`; each CUDA kernel is put in one class by
its name (matmuls, FlexAttention, the loss, the optimizer, inductor's fused elementwise and reduction
kernels, copies), with its share of the GPU's time, and the matmuls' achieved TFLOP/s against the model's
matmul FLOPs. Says which lever is worth pulling: a class that holds a tenth of the step can give at most a
tenth. Writes bench/results/kernels-<date>.md.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch

from bench.common import table, write_result
from bench.trainbench import apply_smoke, common_args, warm_synthetic_steps
from lmpipe.consumer.report import peak_flops

# first match wins; names as CUDA, cuBLAS, Triton (inductor) and FlexAttention give them
CLASSES = [
    ("matmul (cuBLAS/CUTLASS)", r"gemm|nvjet|cutlass|sm90_xmma|sm80_xmma|ampere_|splitK"),
    ("FlexAttention", r"flex_attention|flex_decoding|triton_tem_fused"),
    ("optimizer (fused AdamW, grad norm)", r"adam|multi_tensor|foreach|_amp_|norm_kernel"),
    ("loss (log-softmax, cross-entropy)", r"log_softmax|nll_loss|cross_entropy|logsumexp"),
    ("inductor fused reductions (layer norm, loss, sums)", r"triton_red|triton_per"),
    ("inductor fused elementwise (GELU, adds, casts)", r"triton_poi"),
    ("copies and fills", r"copy|Memcpy|Memset|fill|cat"),
    ("NCCL", r"nccl"),
]


BLOCKING = (
    r"^cuda(Stream|Device|Event)Synchronize|^cudaMemcpy$|^cudaMemcpyAsync|^cuda(Malloc|Free)|^cudaHostAlloc"
    r"|^aten::(item|_local_scalar_dense|nonzero|is_nonzero|masked_select|unique)"
)


def classify(name: str) -> str:
    return next((c for c, pat in CLASSES if re.search(pat, name, re.I)), "other")


def gpu_idle(events, steps: int, top: int = 8) -> tuple[float, list[list]]:
    """ms per step with no kernel running (between the first kernel and the last, over all streams), and the
    `top` longest gaps: [ms, the kernel before, the kernel after]."""
    ks = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation),
        key=lambda e: e.time_range.start,
    )
    if not ks:
        return float("nan"), []
    idle, gaps, end, last = 0.0, [], ks[0].time_range.end, ks[0]
    for e in ks[1:]:
        if e.time_range.start > end:
            gap = (e.time_range.start - end) / 1e3
            idle += gap
            gaps.append([round(gap, 3), last.name[:60], e.name[:60]])
        if e.time_range.end > end:
            end, last = e.time_range.end, e
    return idle / steps, sorted(gaps, key=lambda g: -g[0])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(model="gpt2-124m", seq_len=1024, batch_size=32, warmup=15, steps=10)
    p.add_argument("--top", type=int, default=15, help="kernels listed by GPU time")
    args = apply_smoke(p.parse_args())
    step = warm_synthetic_steps(args, step_graph=False)  # each kernel by name, not a graph's replay
    trainer, tcfg, sync, cuda = step.trainer, step.tcfg, step.sync, step.trainer.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(args.warmup + i)
        sync()
        wall = (time.perf_counter() - t0) / args.steps
    # user annotations (Optimizer.step#AdamW.step) span kernels that are counted on their own: left out
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    idle, gaps = gpu_idle(prof.events(), args.steps)
    # what makes the host wait for the GPU (a sync ends the host's lead, and the GPU idles while the host
    # launches the next kernels): CUDA runtime calls and the aten ops that sync, by host time per step
    blocking = [
        [e.key[:70], e.count // args.steps, f"{e.cpu_time_total / 1e3 / args.steps:.3f}"]
        for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
        if e.device_type == torch.autograd.DeviceType.CPU and re.search(BLOCKING, e.key)
    ][:12]
    per_class: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_class[classify(e.key)] += e.self_device_time_total / 1e3 / args.steps  # ms per step
    gpu = sum(per_class.values()) or float("nan")  # nan off CUDA: no kernel times to share out
    model, T = trainer.model, args.seq_len
    tokens = args.batch_size * T
    flops = model.flops_per_token(T) * tokens
    cfg = model.config
    attention_flops = 12 * cfg.n_layer * cfg.n_embd * T * tokens
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else 0.0
    rows = [
        [c, f"{ms:.2f}", f"{100 * ms / gpu:.1f}"] for c, ms in sorted(per_class.items(), key=lambda x: -x[1])
    ]
    rows.append(["GPU total", f"{gpu:.2f}", "100.0"])
    mm = per_class.get(CLASSES[0][0], 0.0)
    facts = [
        ["wall time per step", f"{1e3 * wall:.2f} ms (GPU busy {100 * gpu / (1e3 * wall):.1f}%)"],
        ["tokens/s", f"{tokens / wall:,.0f}"],
        ["MFU (6N + attention, PaLM)", f"{100 * flops / wall / peak:.1f}%" if peak else "n/a"],
        ["matmul FLOPs per step (6N)", f"{(flops - attention_flops) / 1e12:.2f} TFLOP"],
        [
            "matmuls' achieved rate",
            f"{(flops - attention_flops) / (mm / 1e3) / 1e12:.0f} TFLOP/s" if mm else "n/a",
        ],
        ["time outside matmuls", f"{gpu - mm:.2f} ms per step ({100 * (gpu - mm) / gpu:.1f}% of GPU time)"],
        ["GPU idle between the first and the last kernel", f"{idle:.2f} ms per step"],
    ]
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.top]
    top_rows = [[e.key[:90], classify(e.key), e.count // args.steps, f"{e.self_device_time_total / 1e3 / args.steps:.3f}"]
                for e in top]  # fmt: skip
    body = (
        f"{args.model}, T={T}, batch {args.batch_size} rows, {args.precision}, compile={args.compile}, "
        f"attention {tcfg.attention}, fused CE={args.fused_ce}; synthetic-fed (WikiText-2 batches on the "
        f"device), {args.warmup} untimed + {args.steps} profiled steps.\n\n"
        + table(["", ""], facts)
        + "\n\n## GPU time per step by kind of kernel\n\n"
        + table(["kind", "ms per step", "% of GPU time"], rows)
        + f"\n\n## The {args.top} kernels that take longest\n\n"
        + table(["kernel", "kind", "calls per step", "ms per step"], top_rows)
        + "\n\n## The longest GPU idle gaps (the GPU waiting on the host)\n\n"
        + table(["gap ms", "after kernel", "before kernel"], gaps)
        + "\n\n## Host calls that can wait for the GPU\n\n"
        + table(["call", "calls per step", "host ms per step"], blocking)
    )
    print(body)
    write_result("kernels", "Where a step's GPU time goes", body, args.out)


if __name__ == "__main__":
    main()
