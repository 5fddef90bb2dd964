"""Where a training step's GPU time goes, by kind of kernel (issue: MFU on GPT-2 124M).

    python -m bench.kernels                      # GPT-2 124M, T=1024, 32 rows, bf16, compile, synthetic-fed
    python -m bench.kernels --step-graph --trace # the step as CUDA graphs beside the same step eager; traces

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
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import table, write_result
from bench.trainbench import SyntheticSteps, apply_smoke, common_args, warm_synthetic_steps
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
    r"|^cudaGraphLaunch"
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


def launchers(events) -> dict[str, str]:
    """kernel name -> the ops that launched it in an eager step ("innermost op < its caller"), the two most
    frequent: says which part of the model a kernel named only by its template belongs to."""
    by: dict[str, Counter] = defaultdict(Counter)
    for e in events:
        for k in getattr(e, "kernels", None) or []:
            parent = e.cpu_parent.name if e.cpu_parent is not None else ""
            by[k.name][f"{e.name} < {parent}" if parent else e.name] += 1
    return {k: "; ".join(n[:60] for n, _ in c.most_common(2)) for k, c in by.items()}


@dataclass
class Profile:
    """One variant's profiled steps: wall ms a step, GPU ms a step by class, the longest kernels, idle time."""

    wall: float
    per_class: dict[str, float]
    top: list[list]
    idle: float
    gaps: list[list]
    blocking: list[list]
    launchers: dict[str, str]

    @property
    def gpu(self) -> float:
        return sum(self.per_class.values()) or float("nan")  # nan off CUDA: no kernel times to share out


def profiled(step: SyntheticSteps, first: int, steps: int, top: int, trace: str | None = None) -> Profile:
    cuda = step.trainer.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(first + i)
        step.sync()
        wall = 1e3 * (time.perf_counter() - t0) / steps
    if trace:
        prof.export_chrome_trace(trace)
    # user annotations (Optimizer.step#AdamW.step) span kernels that are counted on their own: left out
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    idle, gaps = gpu_idle(prof.events(), steps)
    # what makes the host wait for the GPU (a sync ends the host's lead, and the GPU idles while the host
    # launches the next kernels): CUDA runtime calls and the aten ops that sync, by host time per step
    blocking = [
        [e.key[:70], e.count // steps, f"{e.cpu_time_total / 1e3 / steps:.3f}"]
        for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)
        if e.device_type == torch.autograd.DeviceType.CPU and re.search(BLOCKING, e.key)
    ][:12]
    per_class: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_class[classify(e.key)] += e.self_device_time_total / 1e3 / steps  # ms per step
    longest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    top_rows = [[e.key, classify(e.key), e.count // steps, f"{e.self_device_time_total / 1e3 / steps:.3f}"]
                for e in longest]  # fmt: skip
    return Profile(wall, dict(per_class), top_rows, idle, gaps, blocking, launchers(prof.events()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(model="gpt2-124m", seq_len=1024, batch_size=32, warmup=15, steps=10)
    p.add_argument("--top", type=int, default=15, help="kernels listed by GPU time")
    p.add_argument("--step-graph", action="store_true",
                   help="also profile the step replayed as CUDA graphs (the trainer's default), side by side "
                        "with the same compiled step issued eagerly: the same kernels, with or without the "
                        "host's launches between them")  # fmt: skip
    p.add_argument("--trace", action="store_true", help="also write each variant's Chrome trace to --out")
    args = apply_smoke(p.parse_args())
    step = warm_synthetic_steps(
        args, fast="auto" if args.step_graph else "auto,-step-graph"
    )  # captured in the warm-up, where it can be
    trainer, tcfg, runner = step.trainer, step.tcfg, step.trainer.runner

    def trace_path(name: str) -> str | None:
        return str(Path(args.out or "bench/results") / f"trace-{name}.json") if args.trace else None

    variants: dict[str, Profile] = {}
    if runner.graphs:
        variants["as CUDA graphs"] = profiled(step, args.warmup, args.steps, args.top, trace_path("graphs"))
        runner.graphs = False  # the same runner, its graph kept aside: each kernel launched on its own
    variants["issued eagerly"] = profiled(
        step, args.warmup + args.steps, args.steps, args.top, trace_path("eager")
    )
    cuda = trainer.device.type == "cuda"
    model, T = trainer.model, args.seq_len
    tokens = args.batch_size * T
    flops = model.flops_per_token(T) * tokens
    cfg = model.config
    attention_flops = 12 * cfg.n_layer * cfg.n_embd * T * tokens
    peak = peak_flops(torch.cuda.get_device_name()) if cuda else 0.0
    names = list(variants)
    profs = list(variants.values())
    classes = sorted({c for v in profs for c in v.per_class}, key=lambda c: -profs[0].per_class.get(c, 0.0))
    rows = [[c] + [f"{v.per_class.get(c, 0.0):.2f}" for v in profs]
            + [f"{100 * profs[0].per_class.get(c, 0.0) / profs[0].gpu:.1f}"] for c in classes]  # fmt: skip
    rows.append(["GPU total"] + [f"{v.gpu:.2f}" for v in profs] + ["100.0"])
    mm = CLASSES[0][0]

    def facts(v: Profile) -> list[str]:
        return [
            f"{v.wall:.2f} ms (GPU busy {100 * v.gpu / v.wall:.1f}%)",
            f"{tokens / v.wall * 1e3:,.0f}",
            f"{100 * flops / (v.wall / 1e3) / peak:.1f}%" if peak else "n/a",
            f"{(flops - attention_flops) / 1e12:.2f} TFLOP",
            f"{(flops - attention_flops) / (v.per_class[mm] / 1e3) / 1e12:.0f} TFLOP/s" if v.per_class.get(mm) else "n/a",
            f"{v.gpu - v.per_class.get(mm, 0.0):.2f} ms per step",
            f"{v.idle:.2f} ms per step",
        ]  # fmt: skip

    labels = ["wall time per step", "tokens/s", "MFU (6N + attention, PaLM)", "matmul FLOPs per step (6N)",
              "matmuls' achieved rate", "GPU time outside matmuls", "GPU idle between the first and last kernel"]  # fmt: skip
    fact_rows = [[label, *col] for label, *col in zip(labels, *(facts(v) for v in profs))]
    body = (
        f"{args.model}, T={T}, batch {args.batch_size} rows, {args.precision}, compile={args.compile} "
        f"({args.compile_mode}), attention {tcfg.attention}, fused CE={args.fused_ce}; synthetic-fed "
        f"(WikiText-2 batches on the device), {args.warmup} untimed + {args.steps} profiled steps"
        + (", then the same runner's step issued eagerly for as many" if len(profs) > 1 else "")
        + ".\n\n"
        + table(["", *names], fact_rows)
        + "\n\n## GPU time per step by kind of kernel (ms)\n\n"
        + table(["kind", *names, f"% of GPU time ({names[0]})"], rows)
    )
    launched = {k: n for v in profs for k, n in v.launchers.items()}  # a graph's replay names no op: eager's
    for name, v in variants.items():
        top = [[key[:90], *rest, launched.get(key, "")] for key, *rest in v.top]
        body += (
            f"\n\n## The {args.top} kernels that take longest ({name})\n\n"
            + table(["kernel", "kind", "calls per step", "ms per step", "launched by (eager)"], top)
            + f"\n\n## The longest GPU idle gaps ({name})\n\n"
            + table(["gap ms", "after kernel", "before kernel"], v.gaps)
            + f"\n\n## Host calls that can wait for the GPU ({name})\n\n"
            + table(["call", "calls per step", "host ms per step"], v.blocking)
        )
    print(body)
    write_result("kernels", "Where a step's GPU time goes", body, args.out)


if __name__ == "__main__":
    main()
