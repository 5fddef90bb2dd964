"""The trainer's fixed cost per step, for a model small enough that it dominates (issue: small models must
become data-bound, not overhead-bound).

    python -m bench.overhead                     # tiny model, 32 x 256 rows, bf16, on CUDA

1. Where a step's time goes (synthetic-fed, torch.compile default mode): wall time per step against the
   GPU's kernel time per step (torch.profiler), the block-mask build alone, and the host-side operators
   that cost the most.
2. Step time and tokens/s, synthetic-fed and pipeline-fed, side by side: eager, compile, and compile with
   CUDA graphs (mode reduce-overhead), so "halved" is a ratio measured in one run.
Writes bench/results/overhead-<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

from bench.common import table, write_result
from bench.trainbench import (
    SyntheticSteps,
    apply_smoke,
    bench_data,
    common_args,
    measure_pipeline,
    measure_synthetic,
    pipeline_config,
    train_config,
)
from lmpipe.consumer import inputs
from lmpipe.consumer.inputs import build_inputs, document_causal_mask_mod

EAGER = "auto,-step-graph"  # every default fast path but the step graph
VARIANTS = [
    ("eager (no compile)", {"compile": False, "fast": EAGER}),
    ("compile (default mode)", {"compile": True, "fast": EAGER}),
    # the step as it was before the host-built block mask and document_block_mask: "halved" measured in
    # this run, not across runs
    ("compile, block mask from create_block_mask (before)", {"compile": True, "fast": EAGER}),
    (
        "compile + CUDA graphs (reduce-overhead)",
        {"compile": True, "compile_mode": "reduce-overhead", "fast": EAGER},
    ),
    ("compile + the whole step as CUDA graphs (--fast step-graph)", {"compile": True, "fast": "auto"}),
]


@contextlib.contextmanager
def create_block_mask_builder():
    """Build every batch's block mask with FlexAttention's create_block_mask, as the trainer did before."""
    saved = inputs.document_block_mask, inputs.document_block_mask_host

    def old(seg: torch.Tensor, block: int = 128):
        B, L = seg.shape
        return create_block_mask(inputs.document_causal_mask_mod(seg), B, None, L, L, device=seg.device)

    inputs.document_block_mask = old
    inputs.document_block_mask_host = lambda seg_host, seg, block=128: old(seg, block)
    try:
        yield
    finally:
        inputs.document_block_mask, inputs.document_block_mask_host = saved


def profile(pcfg, tcfg, warmup: int, steps: int) -> tuple[list[list], str]:
    """Wall vs GPU time per step and the host operators that cost most, over `steps` synthetic steps."""
    step = SyntheticSteps(pcfg, tcfg)
    data, sync, cuda = step.data, step.sync, step.trainer.device.type == "cuda"

    for i in range(warmup):
        step(i)
    sync()
    # the block mask alone: built for each batch, shared by the layers; from the host copy of seg (as the
    # trainer does), and from the device copy (document_block_mask, the builder before that)
    t0 = time.perf_counter()
    for i in range(steps):
        tok, lengths, seg, _, _, seg_host = data[i % len(data)]
        build_inputs(tok, lengths, seg, attention=tcfg.attention, mask_cache=None, seg_host=seg_host)
    sync()
    mask_ms = 1e3 * (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for i in range(steps):
        tok, lengths, seg, _, _, _ = data[i % len(data)]
        build_inputs(tok, lengths, seg, attention=tcfg.attention, mask_cache=None)
    sync()
    device_mask_ms = 1e3 * (time.perf_counter() - t0) / steps
    # FlexAttention's own builder on the same batches, side by side (what the trainer used before)
    t0 = time.perf_counter()
    for i in range(steps):
        seg = data[i % len(data)][2]
        if seg is not None:
            B, L = seg.shape
            create_block_mask(document_causal_mask_mod(seg.int()), B, None, L, L, device=seg.device)
    sync()
    old_mask_ms = 1e3 * (time.perf_counter() - t0) / steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(warmup + i)
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_ms = gpu_us / 1e3 / steps
    launches = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
    )
    rows = [
        ["wall time per step", f"{wall_ms:.2f} ms"],
        ["GPU kernel time per step", f"{gpu_ms:.2f} ms ({100 * gpu_ms / wall_ms:.0f}% of the wall)"],
        ["kernel launches per step", f"{launches / steps:.0f}"],
        ["inputs + block mask per batch, alone (from the host copy of seg)", f"{mask_ms:.2f} ms"],
        ["the same from the device copy (document_block_mask)", f"{device_mask_ms:.2f} ms"],
        ["the same with create_block_mask (the builder used before)", f"{old_mask_ms:.2f} ms"],
    ]
    top = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    return rows, top


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(model="tiny", seq_len=256, batch_size=32, vocab_size=0, warmup=30, steps=100)
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--skip-pipeline", action="store_true", help="synthetic-fed rows only")
    p.add_argument("--only", nargs="+", default=None, help="variants whose names contain one of these")
    args = apply_smoke(p.parse_args())
    tok, shards = bench_data(Path(args.work))
    pcfg = pipeline_config(shards, tok, args)
    prof_rows, top = profile(pcfg, train_config(args), args.warmup, args.profile_steps)
    for r in prof_rows:
        print(*r, sep=": ", flush=True)
    rows, base = [], {}
    for name, over in VARIANTS:
        if args.only and not any(o in name for o in args.only):
            continue
        for fed in ("synthetic", "pipeline"):
            if fed == "pipeline" and args.skip_pipeline:
                continue
            tcfg = train_config(args, **over)
            with create_block_mask_builder() if "(before)" in name else contextlib.nullcontext():
                if fed == "synthetic":
                    r = measure_synthetic(pipeline_config(shards, tok, args), tcfg, args.warmup)
                else:
                    r = measure_pipeline(pipeline_config(shards, tok, args), tcfg, args.warmup)
            base.setdefault(fed, r.step_ms)
            rows.append([name, fed, r.step_ms, base[fed] / r.step_ms, r.tokens_per_second, 100 * r.data_wait])
            print(f"{name}, {fed}: {r.step_ms:.2f} ms/step, {r.tokens_per_second:,.0f} tok/s", flush=True)
    body = (
        f"{args.model}, T={args.seq_len}, batch {args.batch_size} rows, {args.precision}, "
        f"{args.producers} producers (pipeline rows); {args.warmup} untimed + {args.steps} timed steps.\n\n"
        f"## Where a step goes (synthetic-fed, compile default, {args.profile_steps} profiled steps)\n\n"
        + table(["", ""], prof_rows)
        + "\n\nHost operators by self CPU time:\n\n```\n"
        + top
        + "\n```\n\n## Step time side by side\n\n"
        + table(["variant", "fed by", "step ms", "speed vs the first row", "tokens/s", "data wait %"], rows)
    )
    print(body)
    write_result("overhead", "Per-step overhead of a small model", body, args.out)


if __name__ == "__main__":
    main()
