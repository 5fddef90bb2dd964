"""FP8 against bf16: tokens/s and the loss after the same steps on the same data, one run.

    python -m bench.fp8                          # GPT-2 124M, T=1024, 32 rows, 40 + 300 steps each

Both runs are pipeline-fed from the same WikiText-2 shards with the same seeds; fp8 converts the blocks'
Linear layers to torchao's float8 training layers (--precision fp8). Writes bench/results/fp8-<date>.md.
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
    pipeline_config,
    train_config,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(batch_size=32, warmup=40, steps=300)
    args = apply_smoke(p.parse_args())
    tok, shards = bench_data(Path(args.work))
    rows, res = [], {}
    for precision in ("bf16", "fp8"):
        tcfg = train_config(args, precision=precision if not args.smoke else "fp32")
        r = res[precision] = measure_pipeline(pipeline_config(shards, tok, args), tcfg, args.warmup)
        print(f"{precision}: {r.tokens_per_second:,.0f} tok/s, final loss {r.final_loss:.4f}", flush=True)
    b = res["bf16"]
    for precision, r in res.items():
        rows.append([precision, r.tokens_per_second, r.tokens_per_second / b.tokens_per_second, 100 * r.mfu,
                     r.peak_memory_gib, r.final_loss, 100 * (r.final_loss / b.final_loss - 1)])  # fmt: skip
    body = (
        f"{args.model}, T={args.seq_len}, batch {args.batch_size} rows, peak lr {args.lr:g}, compile={args.compile}, "
        f"{args.producers} producers serving WikiText-2 shards; {args.warmup} untimed + {args.steps} timed steps "
        "each. MFU counts the same FLOPs against the bf16 peak. Final loss: the last 10 steps' mean.\n\n"
        + table(
            ["precision", "tokens/s", "vs bf16", "MFU %", "peak GiB", "final loss", "loss vs bf16 %"], rows
        )
        + "\n\nTargets: fp8 >= 1.2x bf16 tokens/s, final loss within 1%."
    )
    print(body)
    write_result("fp8", "FP8 (torchao float8) against bf16", body, args.out)


if __name__ == "__main__":
    main()
