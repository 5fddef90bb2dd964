"""The time from a killed trainer rank to training again, under torchrun's elastic restarts.

    python -m bench.rank_restart                     # 2 GPUs: GPT-2 124M on WikiText-2, one rank per GPU
    python -m bench.rank_restart --smoke             # the tiny model on CPU (gloo), the built-in corpus

`torchrun --nnodes 1 --nproc-per-node N --max-restarts 1 --rdzv-backend c10d -m lmpipe run ... --resume auto`
trains, checkpointing every --checkpoint-every steps; right after the checkpoint at --kill-at, rank N-1 is
killed with SIGKILL. torchrun's agent stops the other ranks and starts them all again; each resumes from
the last checkpoint. From the kill, the seconds until: rank 0 names the lost rank; a restarted trainer
listens (imports, model built); it has loaded the checkpoint; the first resumed step is done. Beside them,
one steady step's time before the kill, and the steps trained again (the kill came after the checkpoint's
step; those after it are trained again by the restarted round).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import free_port_pair, smoke_out, table, write_result
from bench.trainbench import bench_data


def _rank_pid(agent: int, rank: int) -> int | None:
    """torchrun's worker `rank`: the agent's child whose environment has RANK=rank (Linux /proc)."""
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                    return int(child)
            except OSError:
                continue
    return None


class Lines:
    """A process's output lines, each with the monotonic time it was read."""

    def __init__(self, p: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(p,), daemon=True)
        self._t.start()

    def _read(self, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, s in list(self.lines) if t >= after and re.search(pattern, s)), None)

    def tail(self) -> str:
        return "\n".join(s for _, s in self.lines[-40:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=20, help="kill a rank right after this step's checkpoint")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, built-in corpus")
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.smoke:
        a.model, a.seq_len, a.batch_size, a.device = "tiny", 64, 4, "cpu"
        a.checkpoint_every, a.kill_at, a.steps, a.out = 3, 6, 30, smoke_out(a.out)
        data = ["--builtin-docs", "2000"]
    else:
        import torch

        if a.device != "cpu" and torch.cuda.device_count() < a.nproc:
            sys.exit(f"--nproc {a.nproc} needs as many GPUs (found {torch.cuda.device_count()}); "
                     "--device cpu runs the ranks on the CPU")  # fmt: skip
        tok, shards = bench_data(work)
        data = ["--data", shards, "--tokenizer", tok, "--vocab-size", "50304"]
    ck = work / "rank-restart-ck"
    shutil.rmtree(ck, ignore_errors=True)
    rdzv = free_port_pair()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.nproc),
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
           "-m", "lmpipe", "run", *data, "--model", a.model, "--seq-len", str(a.seq_len), "--batch-size",
           str(a.batch_size), "--device", a.device, "--producers", "1", "--steps", str(a.steps), "--log-every",
           "1", "--metrics-port", "-1", "--port", str(free_port_pair()), "--checkpoint-dir", str(ck),
           "--checkpoint-every", str(a.checkpoint_every), "--resume", "auto"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")} | {"PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)  # fmt: skip
    out = Lines(job)
    try:
        mark = rf"step-{a.kill_at:08d} written"
        while out.first(mark) is None:
            if job.poll() is not None:
                sys.exit(f"the job ended before step {a.kill_at}'s checkpoint:\n{out.tail()}")
            time.sleep(0.01)
        victim = _rank_pid(job.pid, a.nproc - 1)
        if victim is None:
            sys.exit(f"no rank {a.nproc - 1} among torchrun's workers")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rc = job.wait(timeout=1800)
    finally:
        if job.poll() is None:  # torchrun starts each worker in a session of its own, with its producers
            for task in Path(f"/proc/{job.pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(int(child), signal.SIGKILL)
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    time.sleep(0.2)  # the reader's last lines
    if rc != 0:
        sys.exit(f"the job failed after the kill (exit {rc}):\n{out.tail()}")
    before = [int(m.group(1)) for t, s in out.lines if t < killed and (m := re.match(r"step (\d+)", s))]
    step_lines = [t for t, s in out.lines if re.match(r"step \d+", s)]
    gaps = sorted(b - x for x, b in zip(step_lines, step_lines[1:]) if b < killed)
    named = out.first(r"ended mid-run", killed)
    started = out.first(r"\[trainer\] (?!.*ended mid-run)", named or killed)  # a new worker's first line
    resumed = out.first(r"resumed from ", killed)
    listening = out.first(r"\[trainer\] training ", killed)
    stepped = out.first(r"^step \d+", resumed or killed)
    since = [None if t is None else t - killed for t in (named, started, resumed, listening, stepped)]
    rows = [
        ["rank 0 names the lost rank", since[0], "gloo's collective fails; rank 0 stops"],
        ["a restarted worker's first line", since[1], "the agent stopped the round, met again, started them"],
        ["the checkpoint loaded", since[2], f"imports, model built; resumed at step {a.kill_at}"],
        ["a restarted trainer listens", since[3], ""],
        ["the first resumed step done", since[4], "producers started, first batch, the step"],
        ["one steady step (before the kill)", gaps[len(gaps) // 2] if gaps else None, "median"],
        ["steps trained again", sum(1 for n in before if n > a.kill_at), "after the checkpoint, before the kill"],
    ]  # fmt: skip
    body = (
        f"{a.model}, T={a.seq_len}, {a.batch_size} rows a rank, {a.nproc} ranks ({a.device}), "
        f"`torchrun --max-restarts 1 --rdzv-backend c10d`; rank {a.nproc - 1} killed (SIGKILL) right after "
        f"step {a.kill_at}'s checkpoint. Seconds from the kill.\n\n" + table(["what", "s", "note"], rows)
    )
    print(body)
    write_result("rank-restart", "From a killed rank to training again", body, a.out)


if __name__ == "__main__":
    main()
