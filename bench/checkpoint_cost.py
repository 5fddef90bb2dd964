"""What a checkpoint costs the training: asynchronous (the default on CUDA) against synchronous, against none.

    python -m bench.checkpoint_cost              # GPT-2 124M, T=1024, 32 rows, bf16, --compile, 4 producers

The same pipeline-fed run three times in one process: no checkpoints, --checkpoint-mode async and
--checkpoint-mode sync, each with --checkpoint-every 50 (--every). Reported side by side: steady tokens/s
over the timed steps (checkpoints included) and its ratio to the run without; the time the step loop
stopped per checkpoint (async: the copy of the state into pinned host memory, and any wait for the previous
write; sync: the whole write), median and worst; and how long each write took (async: in the background).
The stop is timed around the trainer's whole save_checkpoint (the state's dicts built, the cursors gathered,
the copy or the write). The first checkpoint, which allocates the host buffers in async mode, falls in the untimed warm-up
(--warmup 60 > --every 50) and is reported on its own. Writes bench/results/checkpoint-cost-<date>.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import start_producers, stop, table, write_result
from bench.trainbench import _reset, apply_smoke, bench_data, common_args, pipeline_config, train_config
from lmpipe.consumer.trainer import Trainer
from lmpipe.shared.config import pipeline_argv

MODES = ("none", "async", "sync")


@dataclass
class Cost:
    tokens_per_second: float
    checkpoints: int = 0  # in the timed steps
    blocked: list[float] = field(default_factory=list)  # seconds the step loop stopped, per timed checkpoint
    first_blocked: float = float("nan")  # the first checkpoint's (async: allocates the host buffers)
    writes: list[float] = field(default_factory=list)  # seconds per write (async: in the background)


def measure(args: argparse.Namespace, mode: str, tok: str, shards: str) -> Cost:
    _reset()
    ck = Path(args.work) / f"checkpoint-cost-{mode}"
    shutil.rmtree(ck, ignore_errors=True)
    over: dict = {"log_every": args.log_every}
    if mode != "none":
        over |= {"checkpoint_dir": str(ck), "checkpoint_every": args.every, "checkpoint_mode": mode,
                 "keep_checkpoints": 2}  # fmt: skip
    pcfg, tcfg = pipeline_config(shards, tok, args), train_config(args, **over)
    trainer = Trainer(pcfg, tcfg)
    blocked: list[tuple[int, float]] = []  # (step, seconds in the trainer's save_checkpoint) per checkpoint
    save = trainer.save_checkpoint

    def timed_save():
        t0 = time.perf_counter()
        path = save()
        blocked.append((trainer.step, time.perf_counter() - t0))
        return path

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    records: list[dict] = []
    procs = start_producers(pipeline_argv(pcfg), pcfg.producers)
    try:
        trainer.run(progress=lambda step, st: records.append(dict(st)))
    finally:
        stop(procs)
    timed = [r for r in records if r["step"] - tcfg.log_every >= args.warmup]
    seconds = sum(r["step_seconds"] * tcfg.log_every for r in timed)
    tokens = sum(r["tokens_per_second"] * r["step_seconds"] * tcfg.log_every for r in timed)
    # the timed steps' checkpoints (not the one at the end of the run, after the last timed step)
    in_window = [s for step, s in blocked if args.warmup < step < args.warmup + args.steps]
    writes = trainer.metrics.checkpoint_seconds.collect()[0].samples
    total = next((s.value for s in writes if s.name.endswith("_sum")), 0.0)
    count = next((s.value for s in writes if s.name.endswith("_count")), 0.0)
    cost = Cost(tokens / seconds if seconds else 0.0, len(in_window), in_window,
                blocked[0][1] if blocked else float("nan"), [total / count] if count else [])  # fmt: skip
    del trainer.save_checkpoint  # the wrapper refers to the trainer: without it, freed on return
    shutil.rmtree(ck, ignore_errors=True)
    return cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(batch_size=32, warmup=60, steps=300)
    p.add_argument("--every", type=int, default=50, help="--checkpoint-every of the runs that checkpoint")
    p.add_argument("--log-every", type=int, default=10, help="steps per measured interval")
    p.add_argument("--only", nargs="+", choices=MODES, default=list(MODES), help="these runs only")
    args = apply_smoke(p.parse_args())
    if args.smoke:
        args.every, args.warmup, args.steps, args.log_every = 3, 4, 9, 1
    tok, shards = bench_data(Path(args.work))
    costs = {mode: measure(args, mode, tok, shards) for mode in args.only}
    base = costs["none"].tokens_per_second if "none" in costs else float("nan")
    rows = []
    for mode, c in costs.items():
        rows.append([
            "no checkpoints" if mode == "none" else f"--checkpoint-mode {mode}",
            f"{c.tokens_per_second:,.0f}",
            f"{c.tokens_per_second / base:.3f}x" if base == base and base > 0 else "",
            c.checkpoints if mode != "none" else "",
            f"{statistics.median(c.blocked):.3f}" if c.blocked else "",
            f"{max(c.blocked):.3f}" if c.blocked else "",
            f"{c.first_blocked:.3f}" if mode != "none" else "",
            f"{c.writes[0]:.2f}" if c.writes else "",
        ])  # fmt: skip
    body = (
        f"{args.model}, T={args.seq_len}, {args.batch_size} rows, {args.precision}, "
        f"{'--compile, ' if args.compile else ''}{args.producers} producers serving WikiText-2 shards; "
        f"{args.steps} timed steps after {args.warmup} untimed, a checkpoint every {args.every} steps "
        "(model + AdamW state + cursors, written with fsync; keep 2). Step-loop stop: from the checkpoint's "
        "start to training going on (async: the copy to pinned host memory and any wait for the write before; "
        "sync: the whole write).\n\n"
        + table(
            [
                "run",
                "steady tokens/s",
                "vs none",
                "checkpoints timed",
                "step loop stopped, median s",
                "worst s",
                "first checkpoint s",
                "write s (mean)",
            ],
            rows,
        )  # fmt: skip
    )
    print(body)
    write_result("checkpoint-cost", "Checkpoint cost: async vs sync vs none", body, args.out)


if __name__ == "__main__":
    main()
