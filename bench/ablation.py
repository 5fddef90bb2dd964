"""Ablation: what each optimization buys. Pipeline-fed, each switched off in turn.

    python -m bench.ablation                     # GPT-2 124M, T=1024, bf16, compile, 4 producers

Prints a table of tokens/s and peak GPU memory and writes bench/results/ablation-<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import unittest.mock
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

# (name, pipeline overrides, trainer overrides[, torch._inductor.config overrides[, module constants]])
VARIANTS: list[tuple] = [
    ("all on", {}, {}),
    ("CUDA graphs (compile mode reduce-overhead)", {}, {"compile_mode": "reduce-overhead"}),
    # the default on one CUDA GPU (consumer/fast/step_graph.py): the row below is the step as the host issues it
    ("the step issued eagerly, not as CUDA graphs (--no-step-graph)", {}, {"step_graph": False}),
    (
        "the step graph's cuBLASLt memsets kept as memset nodes, not kernel nodes",
        {},
        {},
        {},
        {"lmpipe.consumer.fast.memset_nodes.ENABLED": False},
    ),
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
    (
        "clipping in a pass of its own (clip_grad_norm_), not in the fused AdamW",
        {},
        {},
        {},
        {"lmpipe.consumer.step.CLIP_IN_STEP": False},
    ),
    (
        "AdamW as torch's fused kernel, not the Triton one (consumer/fast/adamw.py)",
        {},
        {},
        {},
        {"lmpipe.consumer.fast.adamw.ENABLED": False},
    ),
    (
        "the q/k/v projection's backward as autograd writes it (dq, dk, dv concatenated first)",
        {},
        {},
        {},
        {"lmpipe.consumer.fast.qkv_kernel.ENABLED": False},
    ),
    (
        "the MLP's GELU as kernels of its own, not in cuBLASLt's GEMM epilogues (--no-gelu-epilogue)",
        {},
        {"gelu_epilogue": False},
    ),
    (
        "the LM head's GEMMs as torch picks them, not cuBLASLt's fastest timed (nvmath)",
        {},
        {},
        {},
        {"lmpipe.consumer.fast.loss.TUNED_HEAD_GEMM": False},
    ),
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
    (
        "each logging interval's loss read at once (a host sync that drains the GPU's queue)",
        {},
        {},
        {},
        {"lmpipe.consumer.runstats.REPORT_BEHIND": False},
    ),
    ("no copy stream (H2D on the compute stream)", {}, {"copy_stream": False}),
    ("no torch.compile", {}, {"compile": False}),
    ("no fused AdamW (foreach)", {}, {"fused_adamw": False}),
    ("dense mask instead of FlexAttention", {}, {"attention": "dense"}),
    ("FlashAttention-4 varlen instead of FlexAttention (--attention flash)", {}, {"attention": "flash"}),
    ("fused linear cross-entropy on (liger; one host sync a step)", {}, {"fused_ce": True}),
    ("torch's cross-entropy, not the one-pass loss kernel (--no-loss-kernel)", {}, {"loss_kernel": False}),
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
        inductor, constants = (more + [{}, {}])[:2]
        if args.only and not any(w in name for w in args.only):
            continue
        # --smoke runs on CPU, where fp8 and FlashAttention are refused
        if args.smoke and (tover.get("precision") == "fp8" or tover.get("attention") == "flash"):
            continue
        if missing := [k for k in inductor if not _has_setting(k)]:
            print(f"{name}: skipped, this torch's inductor has no {', '.join(missing)}", flush=True)
            continue
        with torch._inductor.config.patch(**inductor), contextlib.ExitStack() as stack:
            for target, value in constants.items():  # (a module imported only when its row runs)
                stack.enter_context(unittest.mock.patch(target, value))
            r = measure_pipeline(
                pipeline_config(shards, tok, args, **pover), train_config(args, **tover), args.warmup
            )
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
