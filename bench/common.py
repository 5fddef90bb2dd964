"""Shared helpers for the benchmarks: the machine's name, a results file, producers for a trainer."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# the team's copy beside the checkout; LMPIPE_WIKITEXT points elsewhere (the GPU machine gets a carried copy)
WIKITEXT = Path(os.environ.get("LMPIPE_WIKITEXT", REPO.parent / "shared" / "data" / "wikitext-2"))


def card() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def command() -> str:
    """How this benchmark was started (`python -m bench.x ...`), for the results file."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0], REPO)]
    return "python " + shlex.join([*head, *sys.argv[1:]])


def smoke_out(out: str | None) -> str:
    """Where a --smoke run writes: never bench/results, whose files are real measurements."""
    return out or str(Path(tempfile.gettempdir()) / "lmpipe-bench-smoke")


def write_result(name: str, title: str, body: str, out_dir: str | None = None) -> Path:
    """bench/results/<name>-<date>.md (or under out_dir), with date, card and command."""
    today = dt.date.today().isoformat()
    path = Path(out_dir or RESULTS) / f"{name}-{today}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n- date: {today}\n- card: {card()}\n- command: `{command()}`\n\n{body}\n")
    print(f"wrote {path}")
    return path


def cuda_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean GPU milliseconds of fn() over `iters` calls after `warmup`, by CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def start_producers(argv: list[str], n: int) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    env["LMPIPE_LOG_LEVEL"] = "WARNING"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "lmpipe", "produce", *argv, "--worker", str(i), "--metrics-port", "-1"],
            env=env,
        )
        for i in range(n)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
