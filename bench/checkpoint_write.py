"""Where a checkpoint write's seconds go, and what the one-pass write saves: on the host, no GPU needed.

    python -m bench.checkpoint_write                 # GPT-2 124M + AdamW state (1.4 GiB), 3 rounds
    python -m bench.checkpoint_write --model tiny    # a smoke run

The state a GPT-2 124M run checkpoints (model and AdamW state in fp32, as the trainer's snapshot holds it in
host memory) is written in the same process, rounds alternating, by:

- before: the write lmpipe did up to this change, step by step: torch.save with the zip CRC32s, fsync, then
  the file read back for header.json's sha256; plus torch.save alone without CRCs, to show the CRCs' share.
- after: CheckpointManager._write (consumer/checkpoint_io.py: CRC off, the blocks' sha256s computed by threads
  while writing, never read back).

Each row also says how long a ticker thread standing in for the step loop was held up at worst while the
write ran in a thread (the GIL the write holds). Writes bench/results/checkpoint-write-<date>.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import table, write_result
from lmpipe.consumer import checkpoint_io
from lmpipe.consumer.checkpoint import CheckpointManager
from lmpipe.consumer.model import GPT, preset
from lmpipe.shared.files import sha256_file


def trainer_state(model: str) -> dict:
    """A model's and its AdamW's state after one step, as a checkpoint holds it."""
    torch.manual_seed(0)
    m = GPT(preset(model))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    m.zero_grad(set_to_none=True)
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 1, "workers": [[{"cursor": 1}]],
            "rng": {"torch": torch.get_rng_state()}}  # fmt: skip


def old_write(folder: Path, state: dict, crc: bool = True, hash_back: bool = True) -> dict[str, float]:
    """The write before the one-pass one: torch.save (CRCs on), fsync, sha256 read back."""
    folder.mkdir()
    t0 = time.perf_counter()
    torch.serialization.set_crc32_options(crc)
    try:
        with open(folder / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            t1 = time.perf_counter()
            os.fsync(f.fileno())
    finally:
        torch.serialization.set_crc32_options(True)
    t2 = time.perf_counter()
    if hash_back:
        sha256_file(folder / "state.pt")
    return {"serialize": t1 - t0, "fsync": t2 - t1, "hash": time.perf_counter() - t2}


def new_write(folder: Path, state: dict) -> dict[str, float]:
    manager = CheckpointManager(folder.parent)
    manager._write(folder, 1, {}, state)
    p = manager.last_parts
    return {"serialize": p["serialize"], "fsync": p["fsync"], "hash": p["hash_wait"]}


def timed(write: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float], float]:
    """The write in a thread: its seconds, parts (with the CPU seconds of every thread), and the worst
    hold-up of a 1 ms ticker meanwhile."""
    out: dict[str, float] = {}
    t = threading.Thread(target=lambda: out.update(write()))
    worst, t0, cpu = 0.0, time.perf_counter(), time.process_time()
    t.start()
    last = time.perf_counter()
    while t.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last - 0.001), now
    t.join()
    out["cpu"] = time.process_time() - cpu
    return time.perf_counter() - t0, out, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--work", default="/tmp/lmpipe-bench", help="the checkpoints are written here (as checkpoint_cost's)"
    )
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = p.parse_args()
    state = trainer_state(args.model)
    work = Path(args.work) / "checkpoint-write"
    ways: dict[str, Callable[[Path], dict[str, float]]] = {
        "before: torch.save (CRC32) + fsync + sha256 read back": lambda d: old_write(d, state),
        "torch.save without CRC32 + fsync (no sha256)": lambda d: old_write(
            d, state, crc=False, hash_back=False
        ),
        "after: one pass (no CRC32, block sha256s while writing)": lambda d: new_write(d, state),
    }
    runs: dict[str, list[tuple[float, dict[str, float], float]]] = {k: [] for k in ways}
    size = 0
    for _ in range(args.rounds):
        for name, write in ways.items():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            runs[name].append(timed(lambda: write(work / "ck")))  # noqa: B023 (called at once)
            size = (work / "ck" / "state.pt").stat().st_size
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(r[0] for r in runs[next(iter(ways))])
    rows = []
    for name, rs in runs.items():
        total = statistics.median(r[0] for r in rs)
        part = {k: statistics.median(r[1][k] for r in rs) for k in ("serialize", "fsync", "hash", "cpu")}
        rows.append([name, f"{total:.2f}", f"{base / total:.2f}x", f"{part['serialize']:.2f}", f"{part['fsync']:.2f}",
                     f"{part['hash']:.2f}", f"{part['cpu']:.2f}", f"{max(r[2] for r in rs) * 1000:.0f}"])  # fmt: skip
    body = (
        f"{args.model} + AdamW state, {size / 2**30:.2f} GiB state.pt, medians of {args.rounds} rounds on "
        f"{os.cpu_count()} CPUs ({checkpoint_io.THREADS} hashing threads), written under {work.parent}.\n\n"
        + table(
            [
                "write",
                "seconds",
                "speed-up",
                "serialize + write s",
                "fsync s",
                "hash s (read back; after: waited for)",
                "CPU s (all threads)",
                "ticker held up, worst ms",
            ],
            rows,
        )  # fmt: skip
    )
    print(body)
    write_result("checkpoint-write", "Checkpoint write: where the seconds go", body, args.out)


if __name__ == "__main__":
    main()
