"""Resume cost for GPT-2 124M: checkpoint write time, and restart-to-first-step.

    python -m bench.resume                       # on whatever device torch sees

1. `lmpipe run` trains a few steps and checkpoints (the trainer logs the write time of each checkpoint).
2. A fresh `lmpipe run --resume auto` starts: the time from process start to the first step of the
   resumed run, split into start-up (imports, model build), checkpoint load, and producers + first step.
Writes bench/results/resume-<date>.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import free_port_pair, table, write_result
from bench.trainbench import bench_data


def run(cmd: list[str]) -> list[tuple[float, str]]:
    """Run a command; each output line with the seconds since start when it appeared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")} | {"PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = [(time.monotonic() - t0, line.rstrip()) for line in p.stdout]
    if p.wait() != 0:
        raise RuntimeError("\n".join(line for _, line in lines[-30:]))
    return lines


def first(lines, pattern: str) -> tuple[float, str]:
    for t, line in lines:
        if re.search(pattern, line):
            return t, line
    raise RuntimeError(f"no line matches {pattern!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tok, shards = bench_data(Path(args.work))
    ck = Path(args.work) / "resume-ck"
    shutil.rmtree(ck, ignore_errors=True)
    base = [sys.executable, "-m", "lmpipe", "run", "--model", args.model, "--data", shards, "--tokenizer", tok,
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--producers", "1",
            "--vocab-size", "50304", "--metrics-port", "-1", "--checkpoint-dir", str(ck), "--log-every", "1"]  # fmt: skip
    first_run = run([*base, "--steps", "3", "--checkpoint-every", "1", "--port", str(free_port_pair())])
    writes = [float(m.group(1)) for _, line in first_run if (m := re.search(r"written in ([\d.]+) s", line))]
    size = sum(f.stat().st_size for f in next(ck.glob("step-*")).iterdir()) / 2**20
    resumed = run([*base, "--steps", "4", "--resume", "auto", "--port", str(free_port_pair())])
    t_session, _ = first(resumed, r"\[trainer\] training ")
    t_resumed, _ = first(resumed, r"resumed from ")
    t_step, _ = first(resumed, r"^step 4/4")
    rows = [
        [
            "checkpoint write (state.pt + header, fsync, rename)",
            f"{min(writes):.2f} - {max(writes):.2f} s",
            f"{size:.0f} MiB",
        ],
        [
            "restart: process start to checkpoint loaded",
            f"{t_resumed:.2f} s",
            "imports, model and optimizer built, weights loaded",
        ],
        ["restart: to trainer listening", f"{t_session:.2f} s", ""],
        [
            "restart: to the first resumed step done",
            f"{t_step:.2f} s",
            "includes producer start-up and handshake",
        ],
    ]
    body = (
        f"{args.model} (vocab 50304), T={args.seq_len}, {args.batch_size} rows, 1 producer serving shards. "
        f"Checkpoint: model + AdamW state + cursors, {size:.0f} MiB on disk.\n\n"
        + table(["what", "time", "note"], rows)
    )
    print(body)
    write_result("resume", "Resume cost", body, args.out)


if __name__ == "__main__":
    main()
