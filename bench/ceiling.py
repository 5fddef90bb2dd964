"""Ceiling: the same model and step fed by the pipeline vs by batches already on the GPU.

    python -m bench.ceiling                      # GPT-2 124M, T=1024, bf16, compile, 4 producers

Prints a table and writes bench/results/ceiling-<date>.md. The pipeline is "free" when its tokens/s is
within a few percent of the synthetic run and data wait stays near zero.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import table, write_result
from bench.trainbench import (
    apply_smoke,
    bench_data,
    common_args,
    measure_pipeline,
    measure_synthetic,
    pipeline_config,
    train_config,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    args = apply_smoke(p.parse_args())
    tok, shards = bench_data(Path(args.work))
    pcfg, tcfg = pipeline_config(shards, tok, args), train_config(args)
    synth = measure_synthetic(pcfg, tcfg, args.warmup)
    pipe = measure_pipeline(pipeline_config(shards, tok, args), train_config(args), args.warmup)
    rows = [
        ["synthetic (batches on the GPU)", synth.tokens_per_second, 100 * synth.mfu, synth.step_ms, 0.0, 1.0],
        ["pipeline (producers + ZeroMQ + copy stream)", pipe.tokens_per_second, 100 * pipe.mfu, pipe.step_ms,
         100 * pipe.data_wait, pipe.tokens_per_second / synth.tokens_per_second],
    ]  # fmt: skip
    body = (
        f"{args.model}, T={args.seq_len}, batch {args.batch_size} rows, {args.precision}, compile={args.compile}, "
        f"fused CE={args.fused_ce}, "
        f"{args.producers} producers serving WikiText-2 shards, pack; {args.warmup} untimed + {args.steps} timed steps. "
        f"MFU against 989 TFLOP/s dense bf16. torch.compile graphs in the pipeline run: {pipe.compiled_graphs}.\n\n"
        + table(["fed by", "tokens/s", "MFU %", "step ms", "data wait %", "vs synthetic"], rows)
    )
    print(body)
    write_result("ceiling", "Pipeline-fed vs synthetic-fed trainer", body, args.out)


if __name__ == "__main__":
    main()
