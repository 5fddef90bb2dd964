"""Elastic producers: tokens/s of a data-bound trainer before and after producers join it mid-run, side by
side in one run, and how long a new producer takes from its start to its batches reaching the trainer.

One trainer (`lmpipe train`, an endless epoch) fed by `--before` producers; its tokens/s and data-wait share
are measured over `--window` seconds from its /metrics. Then `--after - --before` more producers are
started (`lmpipe produce`, nothing else to set: the trainer gives them shards from the busiest producers);
for each, the time from its start to its /metrics first showing a batch sent, and to its shards being
held. Once all have sent, the same window is measured again. A trainer that waited for data trains faster
afterwards; one that did not (data wait near 0) shows that producers were not the bottleneck.

    python -m bench.elastic                                   # built-in corpus, tiny model (CPU or GPU)
    python -m bench.elastic --data ../shared/data/wikitext-2/*.txt --doc-split line --seq-len 1024 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from bench.common import free_port_pair, table, write_result
from bench.stages import scrape


def window(port: int, seconds: float) -> dict[str, float]:
    """Trained tokens/s and the share of step time spent waiting for data, over `seconds`. (scrape: every
    sample summed over its labels, {} while the port does not answer.)"""
    a = scrape(port)
    t0 = time.monotonic()
    time.sleep(seconds)
    b = scrape(port)
    dt = time.monotonic() - t0

    def d(name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    step = d("lmpipe_trainer_step_seconds_sum")
    return {
        "tokens_per_s": d("lmpipe_trainer_tokens_total") / dt,
        "steps_per_s": d("lmpipe_trainer_steps_total") / dt,
        "data_wait": d("lmpipe_trainer_data_wait_seconds_sum") / step if step else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=int, default=1, help="producers at the start")
    ap.add_argument("--after", type=int, default=3, help="producers once the others joined")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--window", type=float, default=15.0, help="seconds each throughput is measured over")
    ap.add_argument(
        "--warmup", type=float, default=10.0, help="seconds after the first step before measuring"
    )
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--data", nargs="*", default=[], help="corpus (default: the built-in one)")
    ap.add_argument("--doc-split", default="blank")
    ap.add_argument("--builtin-docs", type=int, default=200_000)
    ap.add_argument("--trainer-args", default="", help="more `lmpipe train` flags, e.g. '--compile'")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)

    port = free_port_pair()
    tport = free_port_pair()
    pipeline = ["--port", str(port), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
                "--epochs", "0", "--doc-split", args.doc_split, "--builtin-docs", str(args.builtin_docs),
                *(["--data", *args.data] if args.data else [])]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    env["LMPIPE_LOG_LEVEL"] = "WARNING"
    # one core per producer (encode_batch on the calling thread), as in bench.scaling: a producer is the unit
    # users add, and on a many-core host a multi-threaded tokenizer would let one producer take every core
    producer_env = {**env, "TOKENIZERS_PARALLELISM": "false"}
    py = [sys.executable, "-m", "lmpipe"]
    trainer = subprocess.Popen(
        [*py, "train", *pipeline, "--producers", str(args.before), "--shards", str(args.shards), "--steps", "0",
         "--model", args.model, "--metrics-port", str(tport), "--log-every", "100", *args.trainer_args.split()],
        env=env,
    )  # fmt: skip
    producers: list[tuple[subprocess.Popen, int]] = []

    def produce() -> tuple[subprocess.Popen, int]:
        mport = free_port_pair()
        p = subprocess.Popen([*py, "produce", *pipeline, "--metrics-port", str(mport)], env=producer_env)
        producers.append((p, mport))
        return p, mport

    try:
        for _ in range(args.before):
            produce()
        deadline = time.monotonic() + 600
        while scrape(tport).get("lmpipe_trainer_steps_total", 0) < 1:
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the trainer did not start training (exit {trainer.poll()})")
            time.sleep(0.5)
        time.sleep(args.warmup)
        before = window(tport, args.window)
        print(
            f"{args.before} producer(s): {before['tokens_per_s']:,.0f} tokens/s, data wait {before['data_wait']:.1%}"
        )

        joined: list[dict[str, float]] = []
        starts = []
        for _ in range(args.after - args.before):
            starts.append((time.monotonic(), *produce()))
        for t0, p, mport in starts:
            got: dict[str, float] = {}
            deadline = t0 + 300
            while "first_batch_s" not in got:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"a new producer did not send a batch (exit {p.poll()})")
                m = scrape(mport)
                now = time.monotonic() - t0
                if m:  # serving /metrics
                    got.setdefault("metrics_up_s", now)
                    if m.get("lmpipe_producer_shards_held", 0) > 0:
                        got.setdefault("shards_s", now)
                    if m.get("lmpipe_producer_batches_sent_total", 0) > 0:
                        got["first_batch_s"] = now
                time.sleep(0.05)
            joined.append(got)
        time.sleep(args.warmup / 2)
        after = window(tport, args.window)
        print(
            f"{args.after} producer(s): {after['tokens_per_s']:,.0f} tokens/s, data wait {after['data_wait']:.1%}"
        )
    finally:
        trainer.send_signal(signal.SIGTERM)
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            trainer.kill()
        for p, _ in producers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        codes = [trainer.returncode, *(p.wait() for p, _ in producers)]
        if any(codes):
            print(f"exit codes (trainer, producers...): {codes}")

    ratio = after["tokens_per_s"] / before["tokens_per_s"] if before["tokens_per_s"] else float("nan")
    rows = [
        [f"{args.before} producer(s)", before["tokens_per_s"], before["steps_per_s"], f"{before['data_wait']:.1%}", 1.0],
        [f"{args.after} producer(s), after the joins", after["tokens_per_s"], after["steps_per_s"],
         f"{after['data_wait']:.1%}", ratio],
    ]  # fmt: skip
    joins = [
        [i + 1, j.get("metrics_up_s", float("nan")), j.get("shards_s", float("nan")), j["first_batch_s"]]
        for i, j in enumerate(joined)
    ]
    corpus = " ".join(args.data) if args.data else f"built-in corpus ({args.builtin_docs:,} documents)"
    body = (
        f"{corpus}, pack, T={args.seq_len}, {args.batch_size} rows, model {args.model}, {args.shards} shards; "
        f"one core per producer (TOKENIZERS_PARALLELISM=false); one trainer, {args.before} producer(s), then {args.after - args.before} more started mid-run "
        f"(measured over {args.window:.0f} s windows, side by side in one run).\n\n"
        + table(["producers", "tokens/s", "steps/s", "data wait", "vs before"], rows)
        + "\n\nTime from a new producer's start (seconds):\n\n"
        + table(["producer", "/metrics up", "holds shards", "first batch sent"], joins)
        + "\n\nThe trainer takes a producer's batches in arrival order from a few host slots, so a batch sent "
        "is trained within a few steps."
    )
    print(body)
    write_result("elastic", "Elastic producers: tokens/s before and after producers join", body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
