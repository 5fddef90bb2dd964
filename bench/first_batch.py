"""Time to the first batch in hand: lmpipe's Loader against a DataLoader with as many workers, the same
corpus, tokenizer and packing (bench/hf_feed.py's two feeds, without the model), each measured in a fresh
process, several repetitions alternated, medians.

    python -m bench.first_batch --device cpu --reps 5

Each feed is measured twice: with nothing between constructing the loader and its first iter() (idle 0),
and with IDLE seconds between them (default 1), a stand-in for what a training script does there (build
its model). The Loader's constructor starts its producers' zygote (lmpipe/zygote.py), whose imports and
tokenizer load then overlap that time; the DataLoader's workers fork at iter(). Per run: `constructor`,
`loop` (the first iter() to the first batch in hand), and for the Loader `start` (the producers forked,
sockets bound) and `wait` (start to the first batch). `first_batch` is constructor + loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import WIKITEXT
from bench.hf_feed import dataloader, dataloader_batches, lmpipe_loader
from bench.trainbench import bench_data

FEEDS = ("lmpipe", "dataloader")


def child(a) -> dict:
    from lmpipe.shared.tokenizer import load_tokenizer  # as bench/hf_feed.py: imported with the model

    load_tokenizer(a.tok)
    device = torch.device(a.device)
    t0 = time.perf_counter()
    loader = lmpipe_loader(a, device) if a.child == "lmpipe" else dataloader(a, device)
    constructed = time.perf_counter()
    time.sleep(a.idle)
    t1 = time.perf_counter()
    if a.child == "dataloader":
        next(iter(dataloader_batches(loader, device)))
        t3 = time.perf_counter()
        return {"first_batch": constructed - t0 + t3 - t1, "constructor": constructed - t0, "loop": t3 - t1}
    loader.start()
    t2 = time.perf_counter()
    next(iter(loader))
    t3 = time.perf_counter()
    loader.close()
    return {"first_batch": constructed - t0 + t3 - t1, "constructor": constructed - t0, "loop": t3 - t1,
            "start": t2 - t1, "wait": t3 - t2}  # fmt: skip


def measure(a, text: list[str], idle: float, reps: int) -> dict[str, list[dict]]:
    """Each feed `reps` times, alternated, each in a fresh process."""
    runs: dict[str, list[dict]] = {feed: [] for feed in FEEDS}
    for _ in range(reps):
        for feed in FEEDS:
            cmd = [sys.executable, "-m", "bench.first_batch", "--child", feed, "--text", *text, "--tok", a.tok,
                   "--workers", str(a.workers), "--shards", str(a.shards), "--device", a.device,
                   "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--idle", str(idle)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"{feed}: exit {out.returncode}\n{out.stderr[-3000:]}")
            runs[feed].append(json.loads(lines[-1][7:]))
    return runs


def medians(rs: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rs) for k in rs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--idle", type=float, default=1.0, help="seconds between constructor and loop (0: once)")
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--child", choices=FEEDS, help=argparse.SUPPRESS)
    p.add_argument("--text", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, on both sides (as bench/hf_feed.py)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    a.tok, _ = bench_data(Path(a.work))
    text = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    for idle in sorted({0.0, a.idle}):
        for feed, rs in measure(a, text, idle, a.reps).items():
            spread = [round(r["first_batch"], 2) for r in rs]
            print(f"idle {idle:g} s  {feed:10s} " + "  ".join(f"{k} {v:.3f} s" for k, v in medians(rs).items())
                  + f"  (first_batch: {spread})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
