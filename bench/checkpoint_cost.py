"""What a checkpoint costs the training: asynchronous (the default on CUDA) against synchronous, against none.

    python -m bench.checkpoint_cost              # GPT-2 124M, T=1024, 32 rows, bf16, --compile, 4 producers

The same pipeline-fed run three times in one process: no checkpoints, --checkpoint-mode async and
--checkpoint-mode sync, each with --checkpoint-every 50 (--every). Reported side by side: steady tokens/s
over the timed steps (checkpoints included) and its ratio to the run without; the time the step loop
stopped per checkpoint (async: the copy of the state into pinned host memory, and any wait for the previous
write; sync: the whole write), median and worst; and how long each write took (async: in the background).
The stop is timed around the trainer's whole save_checkpoint (the state's dicts built, the cursors gathered,
the copy or the write). The first checkpoint, which allocates the host buffers in async mode, falls in the untimed warm-up
(--warmup 60 > --every 50) and is reported on its own. A second table says where the seconds went: the
stop's wait for the write before, its copy (and the copy's seconds on the GPU), the rest of save_checkpoint;
each write's serialization (with the wait for its hashes) and fsync (CheckpointWriter.last_stop,
CheckpointManager.last_parts). Writes bench/results/checkpoint-cost-<date>.md.
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
    # per timed checkpoint, the stop's parts (CheckpointWriter.last_stop): the wait for the write before,
    # the copy (async), the write (sync) and the rest of save_checkpoint (state dicts, cursors, header)
    parts: list[dict[str, float]] = field(default_factory=list)
    copy_device: list[float] = field(
        default_factory=list
    )  # async on CUDA: the copy's GPU seconds (not the first)
    write_parts: list[dict[str, float]] = field(
        default_factory=list
    )  # per write: CheckpointManager.last_parts


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
    # (step, seconds in the trainer's save_checkpoint, its parts) per checkpoint
    blocked: list[tuple[int, float, dict[str, float]]] = []
    written: list[dict[str, float]] = []  # the write's parts, per write
    copies: list[float] = []  # async on CUDA: the copy's seconds on the GPU, per checkpoint
    save = trainer.save_checkpoint

    def timed_save():
        t0 = time.perf_counter()
        path = save()
        total = time.perf_counter() - t0
        parts = dict(trainer.writer.last_stop) if trainer.writer else {}
        parts["rest"] = total - sum(parts.values())
        blocked.append((trainer.step, total, parts))
        if (
            trainer.writer is not None
            and trainer.writer.snapshot is not None
            and trainer.writer.snapshot.cuda
        ):
            copies.append(trainer.writer.snapshot.copy_seconds)
        return path

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    if trainer.checkpoints is not None and trainer.writer is not None:
        manager, write = trainer.checkpoints, trainer.checkpoints.save

        def parted_write(*a, **kw):  # in the writer thread when async
            path = write(*a, **kw)
            written.append(dict(manager.last_parts))
            return path

        manager.save = parted_write  # type: ignore[method-assign]
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
    window = [(s, parts) for step, s, parts in blocked if args.warmup < step < args.warmup + args.steps]
    in_window = [s for s, _ in window]
    writes = trainer.metrics.checkpoint_seconds.collect()[0].samples
    total = next((s.value for s in writes if s.name.endswith("_sum")), 0.0)
    count = next((s.value for s in writes if s.name.endswith("_count")), 0.0)
    cost = Cost(tokens / seconds if seconds else 0.0, len(in_window), in_window,
                blocked[0][1] if blocked else float("nan"), [total / count] if count else [],
                [parts for _, parts in window], copies[1:], written[1:])  # fmt: skip
    del trainer.save_checkpoint  # the wrapper refers to the trainer: without it, freed on return
    shutil.rmtree(ck, ignore_errors=True)
    return cost


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else ""


def parts_table(costs: dict[str, Cost]) -> str:
    """Where each checkpoint's seconds go (medians over the timed checkpoints; writes after the first)."""
    rows = []
    for mode, c in costs.items():
        if mode == "none":
            continue
        w = c.write_parts
        rows.append([
            mode,
            _median([p.get("wait", 0.0) for p in c.parts]),
            _median([p.get("copy", 0.0) for p in c.parts]),
            _median([p.get("write", 0.0) for p in c.parts]) if mode == "sync" else "",
            _median([p.get("rest", 0.0) for p in c.parts]),
            _median(c.copy_device) if mode == "async" else "",
            f"{statistics.median(p['bytes'] for p in w) / 2**30:.2f}" if w else "",
            _median([p["serialize"] for p in w]),
            _median([p["hash_wait"] for p in w]),
            _median([p["fsync"] for p in w]),
            _median([p["total"] for p in w]),
        ])  # fmt: skip
    return (
        "Where the seconds go, medians. Step-loop stop: waiting for the write before, the copy to pinned host "
        "memory (async; its seconds on the GPU beside), the write (sync), and the rest of the checkpoint (state "
        "dicts, cursors, header). Write (async: in the background): torch.save of state.pt with its blocks' "
        "sha256s computed meanwhile, of that the wait for the hashes, the fsync, the whole save.\n\n"
        + table(
            [
                "checkpoint mode",
                "stop: wait s",
                "stop: copy s",
                "stop: write s",
                "stop: rest s",
                "copy on GPU s",
                "state.pt GiB",
                "write: serialize s",
                "of it hash wait s",
                "write: fsync s",
                "write: total s",
            ],
            rows,
        )  # fmt: skip
    )


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
    body += "\n\n" + parts_table(costs)
    print(body)
    write_result("checkpoint-cost", "Checkpoint cost: async vs sync vs none", body, args.out)


if __name__ == "__main__":
    main()
