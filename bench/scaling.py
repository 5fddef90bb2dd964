"""Scaling: 1, 2, 4, 8, 12 producers (as many as the machine has cores), from raw text and from prepared
shards, feeding a consume-only trainer (`lmpipe train --consume-only`: receive, validate, copy to the device)
and a real model.

    python -m bench.scaling                          # GPT-2 124M on CUDA, a tiny GPT on CPU
    python -m bench.scaling --quick                  # 1 and 2 producers, short windows: < 2 min on 2 cores
    python -m bench.scaling --data corpus.txt        # your text (prepared into shards with `lmpipe prepare`)

Every producer gets one core (TOKENIZERS_PARALLELISM=false: encode_batch on the calling thread), so N
producers against one measures the pipeline rather than the tokenizer's thread pool. The trainer runs in
this process. A run is timed over a window after a warm-up window (compilation, start-up); over that window
the trainer's counters give tokens/s and data wait, each producer's /metrics gives its tokenize time and the
time it was blocked on a full socket (backpressure), /proc gives every producer's and the receive thread's
CPU time. Stages nobody exports per batch (read, pack, encode, decode) are timed once on one core, in
process, on the same documents. Writes bench/results/scaling-<date>.md (and .png with matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import WIKITEXT, free_port_pair, stop, table, write_result
from bench.stages import Snapshot, free_ports, one_core_ceiling, stage_profile, start_producers, window
from bench.trainbench import bench_data
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.trainer import Trainer
from lmpipe.shared.config import PipelineConfig, pipeline_argv

COUNTS = (1, 2, 4, 8, 12)


def measure(pcfg: PipelineConfig, tcfg: TrainConfig, warmup: float, seconds: float) -> dict[str, float]:
    """One run: producers started, the trainer stepping until `warmup + seconds` after its first interval."""
    gc.collect()  # the previous run's trainer (its model, optimizer and pinned slots) goes before this one's
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trainer = Trainer(pcfg, tcfg)
    ports = free_ports(pcfg.producers)
    procs = start_producers(pipeline_argv(pcfg), ports)
    marks: dict[str, object] = {}

    def progress(step: int, stats: dict) -> None:
        # Runs on the trainer's loop: snapshots (an HTTP scrape of every producer) only at the window's
        # marks. Taken at every interval they stalled the loop by ~0.5 ms per producer per scrape, which
        # looked like producers that stop scaling (and like shards getting slower with more producers).
        now = time.perf_counter()
        if "first" not in marks:
            marks["first"] = now
        elif "a" not in marks and now - marks["first"] >= warmup:  # type: ignore[operator]
            marks["a"] = Snapshot.take(trainer, procs, ports)
        elif "a" in marks and now - marks["a"].t >= seconds:  # type: ignore[attr-defined]
            marks["b"] = Snapshot.take(trainer, procs, ports)
            trainer.request_stop("measured")

    try:
        trainer.run(progress=progress)
    finally:
        stop(procs)
    if "b" not in marks:
        raise SystemExit(
            f"{pcfg.producers} producer(s): the run ended before its window ({trainer._stop_reason})"
        )
    return window(marks["a"], marks["b"], pcfg.producers)  # type: ignore[arg-type]


def prepare_shards(data: list[str], tok: str, work: Path) -> str:
    """`lmpipe prepare`, the command a user runs, into `work` (once per corpus and tokenizer)."""
    out = work / f"scaling-shards-{hashlib.sha256(repr((data, tok)).encode()).hexdigest()[:12]}"
    if not (out / "meta.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "lmpipe",
            "prepare",
            "--data",
            *data,
            "--tokenizer",
            tok,
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return str(out)


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(no plot: matplotlib is not installed; `pip install 'lmpipe[bench]'`)"
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((r["source"], r["fed"]) for r in rows):
        rs = [r for r in rows if (r["source"], r["fed"]) == key]
        n = [r["producers"] for r in rs]
        line = ax.plot(n, [r["tokens_per_second"] for r in rs], "o-", label=f"{key[0]} -> {key[1]}")[0]
        ax.plot(n, [rs[0]["tokens_per_second"] * k for k in n], ":", color=line.get_color(), alpha=0.5)
        ax2.plot(
            n, [100 * r["data_wait"] for r in rs], "o-", color=line.get_color(), label=f"{key[0]} -> {key[1]}"
        )
    ax.set(
        xlabel="producers",
        ylabel="tokens/s delivered",
        title="throughput (dotted: N x one producer)",
        yscale="log",
    )
    ax2.set(xlabel="producers", ylabel="data wait %", title="trainer's time waiting for data")
    ax.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"![scaling]({path.name})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--producers", default=",".join(map(str, COUNTS)), help="producer counts (capped at the cores)"
    )
    p.add_argument("--model-producers", help="producer counts for the real model (default: --producers)")
    p.add_argument("--data", nargs="+", help="raw text files (default: WikiText-2 valid + test)")
    p.add_argument("--tokenizer", help="tokenizer JSON (default: a 32k BPE trained on WikiText-2)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--model", help="the real model (default: gpt2-124m on CUDA, tiny on CPU)")
    p.add_argument("--fed", default="consume-only,model", help="what the producers feed")
    p.add_argument("--sources", default="text,shards")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="CUDA: the model uncompiled")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after the first interval, not timed")
    p.add_argument("--seconds", type=float, default=10.0, help="timed window per run")
    p.add_argument("--quick", action="store_true", help="1 and 2 producers, 2 s + 3 s windows")
    p.add_argument("--work", default="/tmp/lmpipe-bench", help="tokenizer and shards are built here once")
    p.add_argument("--out", default=None, help="results directory (default: bench/results)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    device = ("cuda" if args.device == "auto" else args.device) if cuda else "cpu"
    model = args.model or ("gpt2-124m" if cuda else "tiny")
    seq_len = args.seq_len or (1024 if cuda else 256)
    batch_size = args.batch_size or (16 if cuda else 8)
    cores = os.cpu_count() or 1
    counts = [n for n in map(int, args.producers.split(",")) if n <= cores]
    model_counts = [n for n in map(int, (args.model_producers or args.producers).split(",")) if n <= cores]
    if args.quick:
        counts, args.warmup, args.seconds = [n for n in counts if n <= 2], 2.0, 3.0
        model_counts = [n for n in model_counts if n <= 2]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the stage profile: one core, as a producer has

    work = Path(args.work)
    default_tok, wt2_shards = bench_data(work)
    tok = args.tokenizer or default_tok
    text = args.data or [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    shards = wt2_shards if not (args.data or args.tokenizer) else prepare_shards(text, tok, work)
    sources = {"text": text, "shards": [shards]}

    profile, corpus_tokens, n_batches = stage_profile(text, shards, tok, seq_len, batch_size)
    for row in profile:
        print(f"{row[0]}: {row[1]:.3f} s per 1M tokens", flush=True)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lmpipe-scaling-"):
        for source in args.sources.split(","):
            for fed in args.fed.split(","):
                ns = counts if fed == "consume-only" else model_counts
                for n in ns:
                    pcfg = PipelineConfig(data=sources[source], tokenizer=tok, strategy="pack", seq_len=seq_len,
                                          batch_size=batch_size, producers=n, port=free_port_pair(),
                                          shuffle_window=1000)  # fmt: skip
                    tcfg = TrainConfig(consume_only=fed == "consume-only", model=model, steps=0, device=device,
                                       compile=cuda and args.compile and fed == "model", lr=6e-4, warmup=10,
                                       log_every=10 if cuda or fed == "consume-only" else 1, metrics_port=None)  # fmt: skip
                    r = measure(pcfg, tcfg, args.warmup, args.seconds)
                    r.update(source=source, fed=fed if fed != "model" else model, producers=n)
                    base = (
                        next(x for x in rows if (x["source"], x["fed"]) == (r["source"], r["fed"]))
                        if n != ns[0]
                        else r
                    )
                    r["speedup"] = (
                        r["tokens_per_second"] / base["tokens_per_second"]
                        if base["tokens_per_second"]
                        else 0.0
                    )
                    r["efficiency"] = r["speedup"] * base["producers"] / n
                    rows.append(r)
                    print(f"{source} -> {r['fed']}, {n} producer(s): {r['tokens_per_second']:,.0f} tokens/s, "
                          f"x{r['speedup']:.2f}, data wait {100 * r['data_wait']:.1f}%", flush=True)  # fmt: skip

    main_rows = [
        [r["source"], r["fed"], r["producers"], r["tokens_per_second"], r["tokens_per_second"] / r["producers"],
         r["speedup"], r["efficiency"], 100 * r["data_wait"], 100 * r["producer_cpu"], 100 * r["tokenize"],
         100 * r["blocked"], 100 * r["rest"], 100 * r["receive_busy"], r["receive_ms"], r["copy_ms"],
         r["step_ms"]]
        for r in rows
    ]  # fmt: skip
    ceiling_text = one_core_ceiling(
        profile, ["read text (split into documents)", "tokenize (encode_batch, one thread)", "pack into rows",
                  "encode for the wire"])  # fmt: skip
    ceiling_shards = one_core_ceiling(
        profile, ["read shards (memory-mapped)", "pack into rows", "encode for the wire"]
    )
    receive_ceiling = one_core_ceiling(profile, ["trainer: decode + validate"])
    # one file per kind of run, so that runs split over several commands (--fed) keep each other's results
    name = "scaling" + ("" if args.fed == "consume-only,model" else "-" + args.fed.replace(",", "-"))
    name += "-quick" if args.quick else ""
    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    import datetime as dt

    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(rows, out_dir / f"{name}-{dt.date.today().isoformat()}.png")
    body = (
        f"Corpus: {', '.join(Path(t).name for t in text)} ({corpus_tokens:,} tokens); shards of the same "
        f"documents from `lmpipe prepare`. pack, T={seq_len}, {batch_size} rows per batch; model run: {model} on "
        f"{device}{' (compiled)' if cuda and args.compile else ''}. {cores} cores; one core per producer "
        f"(TOKENIZERS_PARALLELISM=false); the trainer in the benchmark's process. Each run: {args.warmup:.0f} s "
        f"untimed after the first logging interval, then {args.seconds:.0f} s timed. Load average at the end: "
        f"{os.getloadavg()[0]:.1f}.\n\n"
        "Columns: tokens/s delivered to the trainer; per producer; x one producer (same source and consumer, "
        "measured in this run); efficiency = speed-up / producers; data wait = share of the trainer's time "
        "spent waiting for a batch. Producers (mean over them): CPU used (% of one core, /proc); and their wall "
        "time split into tokenize (`lmpipe_producer_tokenize_seconds`), blocked on a full socket "
        "(`lmpipe_producer_send_blocked_seconds_total`: the trainer is the limit) and the rest (read, shuffle, "
        "pack, encode, send; and waiting for a core when the machine is busy). Trainer: receive "
        "thread CPU (% of one core; receive, decode, validate, fill a pinned slot) and per batch; copy to the "
        "device per batch (`lmpipe_trainer_h2d_seconds`); step time.\n\n"
        + table(
            [
                "source",
                "fed to",
                "producers",
                "tokens/s",
                "per producer",
                "x one",
                "efficiency",
                "data wait %",
                "prod CPU %",
                "tokenize %",
                "blocked %",
                "rest %",
                "receive thread %",
                "receive ms/batch",
                "copy ms/batch",
                "step ms",
            ],
            main_rows,
        )  # fmt: skip
        + "\n\n"
        + png
        + "\n\n## Where the time goes, one core, no sockets\n\n"
        f"Each stage alone over the whole corpus ({n_batches} batches), in this process, the fastest of 3 "
        "runs: seconds per 1M tokens and microseconds per batch.\n\n"
        + table(["stage", "s per 1M tokens", "us per batch"], profile)
        + f"\n\nOne core's ceiling: {ceiling_text:,.0f} tokens/s from raw text (read + tokenize + pack + encode), "
        f"{ceiling_shards:,.0f} tokens/s from shards (read + pack + encode); the trainer's decode + validate "
        f"alone: {receive_ceiling:,.0f} tokens/s on its one receive thread.\n"
    )
    print(body)
    write_result(name, "Scaling: producers against one, consume-only and a real model", body, args.out)


if __name__ == "__main__":
    main()
