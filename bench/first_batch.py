"""Time from constructing the loader to the first batch in hand: lmpipe's Loader against a DataLoader with
as many workers, the same corpus, tokenizer and packing (bench/hf_feed.py's two feeds, without the model),
each measured in a fresh process, several repetitions alternated, medians.

    python -m bench.first_batch --device cpu --reps 5

The Loader's time is split: the constructor (settings, checks, the tokenizer), start (producers spawned,
sockets bound) and the wait for the first batch (producers import, check, connect, read and pack).
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
from bench.hf_feed import dataloader_batches
from bench.trainbench import bench_data


def child(a) -> dict:
    from lmpipe.shared.tokenizer import load_tokenizer  # as bench/hf_feed.py: imported with the model

    load_tokenizer(a.tok)
    device = torch.device(a.device)
    t0 = time.perf_counter()
    if a.child == "dataloader":
        next(iter(dataloader_batches(a, device)))
        return {"first_batch": time.perf_counter() - t0}
    from lmpipe import Loader

    loader = Loader(data=a.text, tokenizer=a.tok, seq_len=a.seq_len, batch_size=a.batch_size,
                    producers=a.workers, shards=a.shards, shuffle_window=1000, device=a.device,
                    metrics_port=-1)  # fmt: skip
    t1 = time.perf_counter()
    loader.start()
    t2 = time.perf_counter()
    next(iter(loader))
    t3 = time.perf_counter()
    loader.close()
    return {"first_batch": t3 - t0, "constructor": t1 - t0, "start": t2 - t1, "wait": t3 - t2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--child", choices=("lmpipe", "dataloader"), help=argparse.SUPPRESS)
    p.add_argument("--text", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, on both sides (as bench/hf_feed.py)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    a.tok, _ = bench_data(Path(a.work))
    text = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    runs: dict[str, list[dict]] = {"lmpipe": [], "dataloader": []}
    for _ in range(a.reps):
        for feed in runs:
            cmd = [sys.executable, "-m", "bench.first_batch", "--child", feed, "--text", *text, "--tok", a.tok,
                   "--workers", str(a.workers), "--shards", str(a.shards), "--device", a.device,
                   "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                sys.exit(f"{feed}: exit {out.returncode}\n{out.stderr[-3000:]}")
            runs[feed].append(json.loads(lines[-1][7:]))
    for feed, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        spread = [round(r["first_batch"], 2) for r in rs]
        print(f"{feed:10s} " + "  ".join(f"{k} {v:.3f} s" for k, v in med.items()) + f"  (runs: {spread})")


if __name__ == "__main__":
    main()
