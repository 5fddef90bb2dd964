"""Producer throughput: from pre-tokenized shards, from raw text, and the bare tokenizer, on one corpus.

    python -m bench.producer                     # WikiText-2 valid+test, pack, T=1024, 16 rows

Each source runs in its own process, one after the other in this run: the bare tokenizer
(`encode_ids`) over every document (the ceiling for raw text), the producer's full path from raw text
(read, split, tokenize, shuffle, pack into batches) for one shard, the same for `--shards` shards served
round robin as a producer serves them, with one shared read of the corpus per epoch (producer/scan.py) and
with a read per shard (as before the shared read), and the same from shards (no tokenizing). Sockets are
left out: this measures how fast one producer can make batches. Writes bench/results/producer-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import WIKITEXT, table, write_result


def _measure(
    mode: str, tok_path: str, shards: str, seconds: float, seq_len: int, batch_size: int, n: int
) -> dict:
    from lmpipe.producer.batching import BatchSpec, batches
    from lmpipe.producer.scan import SharedScan
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_path)
    files = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    texts = [r.text for r in Corpus(files).records() if r.bad is None] if mode == "tokenizer" else []
    tokens = passes = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if mode == "tokenizer":  # the documents are already in memory: only encoding is timed
            for i in range(0, len(texts), 512):
                tokens += sum(len(ids) for ids in tok.encode_ids(texts[i : i + 512]))
        elif mode.startswith("split"):  # n shards, one batch each in turn (a producer's round robin)
            corpus = Corpus(files)
            scan = SharedScan(corpus, n) if mode == "split-shared" else None
            spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=batch_size)
            streams = [
                DocStream(corpus, tok, w, n, seed=passes, shuffle_window=1000, scan=scan) for w in range(n)
            ]
            for st in streams:
                st.hold()
            live = [batches(st, spec, epochs=1) for st in streams]
            while live:
                for g in list(live):
                    b = next(g, None)
                    if b is None:
                        live.remove(g)
                    else:
                        tokens += b.real_tokens
        else:
            corpus = Corpus([shards] if mode == "shards" else files)
            stream = DocStream(corpus, tok, seed=passes, shuffle_window=1000)
            spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=batch_size)
            tokens += sum(b.real_tokens for b in batches(stream, spec, epochs=1))
        passes += 1
    elapsed = time.perf_counter() - t0
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": elapsed,
        "passes": passes,
        "tokens_per_second": tokens / elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="minimum time per source")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shards", type=int, default=16, help="shards one producer holds (the split rows)")
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    from bench.trainbench import bench_data

    tok, shards = bench_data(Path(args.work))
    if args.child:
        m = _measure(args.child, tok, shards, args.seconds, args.seq_len, args.batch_size, args.shards)
        print(json.dumps(m))
        return
    results = []
    for mode in ("tokenizer", "text", "split-shared", "split-alone", "shards"):
        cmd = [sys.executable, "-m", "bench.producer", "--child", mode, "--seconds", str(args.seconds),
               "--shards", str(args.shards),
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--work", args.work]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{mode}: {results[-1]['tokens_per_second']:,.0f} tokens/s", flush=True)
    bare = results[0]["tokens_per_second"]
    names = {
        "tokenizer": "bare tokenizer (encode_ids only)",
        "text": "producer from raw text (read, tokenize, shuffle, pack), 1 shard",
        "split-shared": f"the same, {args.shards} shards, one shared read of the corpus per epoch",
        "split-alone": f"the same, {args.shards} shards, a read per shard (before the shared read)",
        "shards": "producer from shards (memory-mapped, no tokenizing)",
    }
    rows = [
        [names[r["mode"]], r["tokens_per_second"], r["tokens_per_second"] / bare, r["passes"]]
        for r in results
    ]
    body = (
        f"WikiText-2 valid+test (a BPE tokenizer with 32k tokens trained on it), pack, T={args.seq_len}, "
        f"{args.batch_size} rows; one process per source, {os.cpu_count()} cores visible "
        "(the tokenizer uses all of them). No sockets: the rate at which one producer makes batches.\n\n"
        + table(["source", "tokens/s", "vs bare tokenizer", "passes"], rows)
        + f"\n\n{args.shards} shards with the shared read run at "
        f"{results[2]['tokens_per_second'] / results[1]['tokens_per_second']:.3f}x one shard's speed, and "
        f"{results[2]['tokens_per_second'] / results[3]['tokens_per_second']:.3f}x a read per shard."
    )
    print(body)
    write_result("producer", "Producer throughput by source", body, args.out)


if __name__ == "__main__":
    main()
