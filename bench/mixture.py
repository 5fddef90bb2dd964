"""What a mixture costs: a 3-source mixture against one source of the same documents, in the same run.

    python -m bench.mixture                 # GPT-2 124M on CUDA (bf16, compiled), a tiny GPT on CPU
    python -m bench.mixture --smoke         # tiny, few steps: checks the script, measures nothing
    python -m bench.mixture --slow 0.5      # also: what determinism costs when one producer is slow

The documents (the built-in corpus's, written once as three JSONL files of different sizes) are trained
as one source (`--data` the three files: batches in arrival order) and as a mixture
(`--mix a=...:0.5 b=...:0.3 c=...:0.2`: the trainer picks every row by token deficit). Each
configuration runs as users run it (`lmpipe train` and N `lmpipe produce` processes); the two take turns
for --rounds rounds, so a busy machine slows them alike. The figures are the trainer's own summary
(--summary-json): steady tokens/s and the fraction of the run spent waiting for data; the ratio is the
median over rounds of (mixture / one source) in the same round.

--slow F stops one producer (SIGSTOP/SIGCONT) for a fraction F of every 200 ms, in both configurations:
arrival order trains what comes (the slow producer's shards less often), a mixture trains every source's
shards in turn (the same rows whatever the producers do), so it waits for the slow one. Writes
bench/results/mixture-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import card, free_port_pair, smoke_out, table, write_result

SOURCES = (("a", 0.5, 600), ("b", 0.3, 400), ("c", 0.2, 200))  # name, weight, documents (x --scale)


def write_corpus(work: Path, scale: int) -> dict[str, str]:
    """The three sources' JSONL files (built-in documents, a seed each), once per scale."""
    from lmpipe.producer import builtin_corpus

    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, (name, _, n) in enumerate(SOURCES):
        path = work / f"mix-{name}-{scale}.jsonl"
        if not path.exists():
            docs = (json.dumps({"text": builtin_corpus.document(k + 1, i)}) for i in range(n * scale))
            path.write_text("\n".join(docs) + "\n")
        out[name] = str(path)
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    env.update(LMPIPE_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _throttle(proc: subprocess.Popen, fraction: float, done: threading.Event) -> None:
    """Stop `proc` for `fraction` of every 200 ms until `done`."""
    while not done.is_set() and proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2 * fraction)
        os.kill(proc.pid, signal.SIGCONT)
        done.wait(0.2 * (1 - fraction))


def one_run(data: list[str], args: argparse.Namespace, work: Path, tag: str, slow: float) -> dict:
    """`lmpipe train` fed by --producers `lmpipe produce` processes; the trainer's summary."""
    port = free_port_pair()
    summary = work / f"summary-{tag}.json"
    pipe = ["--port", str(port), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--strategy", "pack", "--epochs", "0", "--producers", str(args.producers), *data]  # fmt: skip
    train = [sys.executable, "-m", "lmpipe", "train", *pipe, "--model", args.model, "--device", args.device,
             "--steps", str(args.steps), "--log-every", str(max(1, args.steps // 6)), "--metrics-port", "-1",
             "--summary-json", str(summary), *(["--precision", args.precision] if args.precision else []),
             *(["--compile"] if args.compile else []), *(["--consume-only"] if args.consume_only else [])]  # fmt: skip
    log = open(work / f"trainer-{tag}.log", "wb")  # noqa: SIM115 - closed below
    trainer = subprocess.Popen(train, stdout=log, stderr=subprocess.STDOUT, env=_env())
    producers = [
        subprocess.Popen(
            [sys.executable, "-m", "lmpipe", "produce", *pipe, "--metrics-port", "-1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=_env(),
        )  # fmt: skip
        for _ in range(args.producers)
    ]
    done = threading.Event()
    if slow:
        threading.Thread(target=_throttle, args=(producers[0], slow, done), daemon=True).start()
    try:
        rc = trainer.wait(timeout=args.timeout)
    finally:
        done.set()
        for p in [trainer, *producers]:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in [trainer, *producers]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    if rc != 0:
        tail = (work / f"trainer-{tag}.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{tag}: the trainer exited {rc}:\n{tail}")
    s = json.loads(summary.read_text())
    return {"tps": s["steady_tokens_per_second"] or s["tokens_per_second"], "wait": s["data_wait_fraction"],
            "mixture": s.get("mixture", {})}  # fmt: skip


def compare(files: dict[str, str], args: argparse.Namespace, work: Path, slow: float) -> list[dict]:
    one = ["--data", *files.values()]
    mix = ["--mix", *(f"{n}={files[n]}:{w}" for n, w, _ in SOURCES)]
    rounds = []
    for r in range(args.rounds):
        a = one_run(one, args, work, f"one-{slow}-{r}", slow)
        b = one_run(mix, args, work, f"mix-{slow}-{r}", slow)
        rounds.append({"one": a, "mix": b, "ratio": b["tps"] / a["tps"] if a["tps"] else float("nan")})
        print(f"slow={slow} round {r}: one source {a['tps']:,.0f} tok/s (wait {100 * a['wait']:.1f}%), mixture "
              f"{b['tps']:,.0f} tok/s (wait {100 * b['wait']:.1f}%)", flush=True)  # fmt: skip
    return rounds


def describe(rounds: list[dict], label: str) -> list:
    med = statistics.median
    return [label, f"{med(r['one']['tps'] for r in rounds):,.0f}", f"{100 * med(r['one']['wait'] for r in rounds):.1f}%",
            f"{med(r['mix']['tps'] for r in rounds):,.0f}", f"{100 * med(r['mix']['wait'] for r in rounds):.1f}%",
            f"{med(r['ratio'] for r in rounds):.3f}"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--model", help="default: gpt2-124m on CUDA, tiny on CPU")
    p.add_argument("--producers", type=int, help="default: 6 on CUDA, 2 on CPU")
    p.add_argument("--seq-len", type=int, help="default: 1024 on CUDA, 64 on CPU")
    p.add_argument("--batch-size", type=int, help="default: 16 on CUDA, 8 on CPU")
    p.add_argument("--precision", help="default: bf16 on CUDA")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None)
    p.add_argument("--steps", type=int, help="steps per run (default: 300 on CUDA, 150 on CPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=10, help="documents: 1200 x this")
    p.add_argument(
        "--slow", type=float, default=0.0, help="also measure with one producer stopped this fraction"
    )
    p.add_argument(
        "--consume-only", action="store_true", help="no model: the pipeline alone (how fast it feeds)"
    )
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None, help="results directory (default: bench/results)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps: measures nothing")
    args = p.parse_args()
    import torch

    cuda = args.device != "cpu" and torch.cuda.is_available() and not args.smoke
    args.device = "cuda" if cuda else "cpu"
    d = {"model": ("gpt2-124m", "tiny"), "producers": (6, 2), "seq_len": (1024, 64), "batch_size": (16, 8),
         "precision": ("bf16", None), "compile": (True, False), "steps": (300, 150)}  # fmt: skip
    for k, (on_cuda, on_cpu) in d.items():
        if getattr(args, k) is None:
            setattr(args, k, on_cuda if cuda else on_cpu)
    if args.smoke:
        args.steps, args.rounds, args.scale, args.out = 12, 1, 1, smoke_out(args.out)
    work = Path(args.work) / "mixture"
    files = write_corpus(work, args.scale)
    results = [describe(compare(files, args, work, 0.0), "all producers at full speed")]
    if args.slow:
        results.append(
            describe(
                compare(files, args, work, args.slow),
                f"one producer stopped {100 * args.slow:.0f}% of the time",
            )
        )
    body = (
        f"{'no model (--consume-only)' if args.consume_only else args.model} on {args.device} ({card()}), {args.producers} producers, pack, T={args.seq_len}, "
        f"B={args.batch_size}, {args.steps} steps a run, {args.rounds} rounds; one source: `--data` the three "
        f"files; mixture: 0.5/0.3/0.2 of them by tokens. Medians over rounds.\n\n"
        + table(
            ["producers", "one source tok/s", "data wait", "mixture tok/s", "data wait", "mixture / one"],
            results,
        )  # fmt: skip
    )
    write_result("mixture", "A 3-source mixture against one source", body, args.out)


if __name__ == "__main__":
    main()
