"""Several GPUs: GPT-2 124M tokens/s per GPU at N = 1, 2, 4 ranks, back to back on one machine, and the loss
of N ranks against one GPU with the same global batch (--accum N).

    python -m bench.ddp                 # N = 1, 2, 4 (as many as the machine has), 4 producers per rank

Each run is the real job: `torchrun --standalone --nproc-per-node N -m lmpipe run` with every rank fed by
its own producers from WikiText-2 shards. Steady-state tokens/s is the median of the status lines' interval
rates after --warmup steps (compilation excluded). Writes bench/results/ddp-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table, write_result
from bench.trainbench import apply_smoke, bench_data, common_args

STATUS = re.compile(r"^step (\d+)/\d+ \| loss [\d.]+ .*\| ([\d,]+) tok/s \| data wait ([\d.]+)%", re.M)
# NVLink multicast stays off on shared machines (the device README); torchrun's children inherit these
SAFE_NCCL = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run(
    n: int, accum: int, args, tok: str, shards: str, port: int, steps: int, extra: list[str] = ()
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               "-m", "lmpipe", "run", "--data", shards, "--tokenizer", tok, "--model", args.model,
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--accum", str(accum),
               "--producers", str(args.producers), "--steps", str(steps), "--precision", args.precision,
               "--vocab-size", str(args.vocab_size), "--lr", "6e-4", "--warmup", "10", "--log-every", "10",
               "--port", str(port), "--metrics-port", "-1", "--summary-json", str(summary)]  # fmt: skip
        if args.compile:
            cmd += ["--compile", "--compile-mode", args.compile_mode]
        cmd += ["--residual-dtype", args.residual_dtype, *extra]
        env = {**os.environ, **SAFE_NCCL, "TOKENIZERS_PARALLELISM": "true"}
        t0 = time.perf_counter()
        # a session of its own: on a timeout the ranks go with torchrun, and what they printed is shown
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            sys.stderr.write(stdout[-4000:] + stderr[-4000:])
            raise SystemExit(
                f"N={n} accum={accum}: no result within --timeout {args.timeout:.0f} s"
            ) from None
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(stdout[-4000:] + stderr[-4000:])
            raise SystemExit(f"N={n} accum={accum}: exit {proc.returncode}")
        lines = [(int(s), float(r.replace(",", "")), float(w)) for s, r, w in STATUS.findall(stdout + stderr)]
        steady = [r for s, r, _ in lines if s > args.warmup]
        waits = [w for s, _, w in lines if s > args.warmup]
        result = json.loads(summary.read_text())
    tps = statistics.median(steady) if steady else 0.0
    return {
        "n": n, "accum": accum, "tokens_per_second": tps, "per_gpu": tps / n,
        "data_wait": statistics.mean(waits) if waits else 0.0, "wall": wall,
        "tail_loss": statistics.mean(result["losses"][-3:]), "losses": result["losses"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.add_argument(
        "--ranks", default="1,2,4", help="world sizes to measure (those above the GPU count skipped)"
    )
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the loss comparison (0: skip it)")
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="also measure N > 1 with these trainer flags, e.g. 'bf16 all-reduce=--grad-reduce bf16' "
        "(against the same N=1 run)",
    )
    args = apply_smoke(p.parse_args())
    gpus = torch.cuda.device_count() or 2  # CPU (gloo): --smoke checks the script with 2 ranks
    ranks = [n for n in map(int, args.ranks.split(",")) if n <= gpus]
    tok, shards = bench_data(Path(args.work), vocab=min(args.vocab_size or 4096, 32768))
    port = 47300
    steps = args.warmup + args.steps
    rows, results = [], {}
    variants = [("", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split()) for v in args.variant]
    for name, extra in variants if args.steps > 0 else []:  # --steps 0: the loss comparison alone
        for n in ranks if not name else [n for n in ranks if n > 1]:
            r = run(n, 1, args, tok, shards, port, steps, extra)
            results.setdefault(name, {})[n] = r
            base = results[""][ranks[0]]["per_gpu"] * n
            label = f"{n} ({name})" if name else n
            rows.append([label, r["tokens_per_second"], r["per_gpu"],
                         r["tokens_per_second"] / base if base else 0.0, r["data_wait"], r["wall"]])  # fmt: skip
            print(rows[-1], flush=True)
    body = (
        f"{args.model}, T={args.seq_len}, {args.batch_size} rows per rank, {args.precision}, "
        f"compile={args.compile}, {args.producers} producers per rank from WikiText-2 shards, pack. "
        f"tokens/s: median of 10-step intervals after {args.warmup} warm-up steps, {args.steps} more.\n\n"
        + table(
            ["ranks (GPUs)", "tokens/s", "tokens/s per GPU", f"vs {ranks[0]} x N", "data wait %", "wall s"],
            rows,
        )  # fmt: skip
    )
    if args.loss_steps and ranks[-1] > 1:
        n = ranks[-1]
        multi = run(n, 1, args, tok, shards, port, args.loss_steps)
        single = run(1, n, args, tok, shards, port, args.loss_steps)
        diff = abs(multi["tail_loss"] - single["tail_loss"]) / single["tail_loss"]
        body += (
            f"\n\nLoss after {args.loss_steps} steps, same global batch ({n} x {args.batch_size} rows): "
            f"{n} ranks {multi['tail_loss']:.4f}, 1 rank with --accum {n} {single['tail_loss']:.4f} "
            f"(mean of the last 3 logged intervals; {100 * diff:.2f}% apart; data order differs by rank).\n"
            f"\n{n} ranks: {' '.join(f'{x:.3f}' for x in multi['losses'])}\n"
            f"\n1 rank:  {' '.join(f'{x:.3f}' for x in single['losses'])}\n"
        )
    print(body)
    write_result("ddp", "Several GPUs: tokens/s per GPU and loss against one GPU", body, args.out)


if __name__ == "__main__":
    main()
