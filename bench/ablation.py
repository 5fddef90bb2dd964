"""Ablation: what each optimization buys. Pipeline-fed, each switched off in turn; every fast path
(consumer/fast/) through --fast: the reference path (--fast none), each default path left out, each opt-in
one added.

    python -m bench.ablation                           # GPT-2 124M, T=1024, bf16, compile, 4 producers
    python -m bench.ablation --only "all on" reference # the default against --fast none, same run

Prints a table of tokens/s and peak GPU memory and writes bench/results/ablation-<date>.md.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch._inductor.config

from bench.common import table, write_result
from bench.trainbench import (
    apply_smoke,
    bench_data,
    common_args,
    measure_pipeline,
    pipeline_config,
    train_config,
)
from lmpipe.consumer.fast import PATHS


def fast_variants() -> list[tuple]:
    """The reference path, then each fast path left out of --fast auto (or, opt-in, added to it)."""
    rows: list[tuple] = [("--fast none: the reference path, no fast path", {}, {"fast": "none"})]
    for path in PATHS:
        if path.default:
            rows.append(
                (f"without {path.name} (--fast auto,-{path.name})", {}, {"fast": f"auto,-{path.name}"})
            )
        else:
            rows.append(
                (f"with opt-in {path.name} (--fast auto,{path.name})", {}, {"fast": f"auto,{path.name}"})
            )
    return rows


# (name, pipeline overrides, trainer overrides[, torch._inductor.config overrides])
VARIANTS: list[tuple] = [
    ("all on", {}, {}),
    *fast_variants(),
    ("CUDA graphs (compile mode reduce-overhead)", {}, {"compile_mode": "reduce-overhead"}),
    (
        "max-autotune (Triton matmul templates, no CUDA graphs)",
        {},
        {"compile_mode": "max-autotune-no-cudagraphs"},
    ),
    # the same, with matmuls left to cuBLAS (which max-autotune picks anyway): what tuned FlexAttention tiles
    # buy, without minutes of matmul autotuning (bench/results/attention-*.md)
    (
        "max-autotune for FlexAttention only (matmuls: cuBLAS)",
        {},
        {"compile_mode": "max-autotune-no-cudagraphs"},
        {"max_autotune_gemm_backends": "ATEN"},
    ),
    # Triton's persistent TMA matmul templates (Hopper) join cuBLAS in the autotuning, and a template may take
    # its epilogue (the GELU after c_fc, a bias, a residual add) instead of a separate pass over the output
    (
        "max-autotune with persistent TMA matmul templates (fused epilogues, no CUDA graphs)",
        {},
        {"compile_mode": "max-autotune-no-cudagraphs"},
        {"triton.enable_persistent_tma_matmul": True},
    ),
    ("fp8 matmuls in the blocks (torchao float8)", {}, {"precision": "fp8"}),
    ("fp32 residual stream, as autocast leaves it (--residual-dtype fp32)", {}, {"residual_dtype": "fp32"}),
    # gpt-fast's and modded-nanogpt's setting: inductor tunes each generated kernel's launch parameters
    ("coordinate-descent tuning (inductor)", {}, {}, {"coordinate_descent_tuning": True}),
    # inductor fuses the layer norms' weight gradients into their backward kernels, each program writing a
    # partial sum to a workspace that an aten sum then reduces: 25 such sums, 0.4 ms a step (H100)
    (
        "layer-norm backward without mix-order reduction (inductor)",
        {},
        {},
        {"triton.mix_order_reduction": False},
    ),
    (
        "mix-order reduction with its split size autotuned (inductor)",
        {},
        {},
        {"triton.mix_order_reduction_autotune_split_size": True},
    ),
    (
        "mix-order reduction, 64 rows a program (inductor)",
        {},
        {},
        {"triton.mix_order_reduction_split_size": 64},
    ),
    # Hopper's programmatic dependent launch: a kernel's prologue overlaps the end of the one before it
    ("programmatic dependent launch (inductor, Hopper)", {}, {}, {"triton.enable_pdl": True}),
    ("no copy stream (H2D on the compute stream)", {}, {"copy_stream": False}),
    ("no torch.compile", {}, {"compile": False}),
    ("no fused AdamW (foreach)", {}, {"fused_adamw": False}),
    ("dense mask instead of FlexAttention", {}, {"attention": "dense"}),
    ("FlashAttention-4 varlen instead of FlexAttention (--attention flash)", {}, {"attention": "flash"}),
    ("fused linear cross-entropy on (liger; one host sync a step)", {}, {"fused_ce": True}),
    ("no TF32", {}, {"tf32": False}),
    ("padding (pad) instead of packing", {"strategy": "pad"}, {}),
    (
        "padding to the batch's longest (pad-batch, multiple 128)",
        {"strategy": "pad-batch", "pad_multiple": 128},
        {},
    ),
]


def _has_setting(dotted: str) -> bool:
    try:
        functools.reduce(getattr, dotted.split("."), torch._inductor.config)
    except AttributeError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.add_argument("--only", nargs="*", help="run only variants whose name contains one of these words")
    args = apply_smoke(p.parse_args())
    tok, shards = bench_data(Path(args.work))
    rows = []
    base = None
    for name, pover, tover, *more in VARIANTS:
        inductor = more[0] if more else {}
        if args.only and not any(w in name for w in args.only):
            continue
        # --smoke runs on CPU, where fp8 and FlashAttention are refused
        if args.smoke and (tover.get("precision") == "fp8" or tover.get("attention") == "flash"):
            continue
        if missing := [k for k in inductor if not _has_setting(k)]:
            print(f"{name}: skipped, this torch's inductor has no {', '.join(missing)}", flush=True)
            continue
        try:
            with torch._inductor.config.patch(**inductor):
                r = measure_pipeline(
                    pipeline_config(shards, tok, args, **pover), train_config(args, **tover), args.warmup
                )
        except ValueError as e:  # e.g. an opt-in fast path that cannot run here: said in one line
            print(f"{name}: skipped, {e}", flush=True)
            continue
        base = base or r.tokens_per_second
        rows.append(
            [
                name,
                r.tokens_per_second,
                r.tokens_per_second / base,
                r.peak_memory_gib,
                100 * r.data_wait,
                100 * r.mfu,
                r.compiled_graphs,
            ]
        )
        print(f"{name}: {r.tokens_per_second:,.0f} tok/s, peak {r.peak_memory_gib:.2f} GiB", flush=True)
    body = (
        f"{args.model}, T={args.seq_len}, batch {args.batch_size} rows, {args.precision}, "
        f"{args.producers} producers serving WikiText-2 shards; {args.warmup} untimed + {args.steps} timed steps per row. "
        "tokens/s counts real (non-pad) tokens. TF32 only touches matmuls left in fp32, "
        "which bf16 autocast leaves few of.\n\n"
        + table(
            ["variant", "tokens/s", "vs all on", "peak GiB", "data wait %", "MFU %", "compiled graphs"], rows
        )
    )
    print(body)
    write_result("ablation", "What each optimization buys (pipeline-fed)", body, args.out)


if __name__ == "__main__":
    main()
