"""Seconds to the first step, side by side in one run on one card: `lmpipe run --compile` on a cold start, a warm
restart (`--resume auto` after a kill -9), the same restart on another host (torch's local compile cache empty:
only lmpipe's cache beside the checkpoints serves) and a second fresh run (a new --checkpoint-dir), against the
same starts of the DataLoader-fed reference loop (bench/peers.py's: lmpipe's model, optimizer and compiled
step fed by torch.utils.data.DataLoader workers that read, tokenize and pack the same raw text).

    python -m bench.warm_start                       # GPT-2 124M, T=1024, 32 rows, 4 producers / workers
    python -m bench.warm_start --smoke               # a tiny model on CPU, uncompiled: checks the script

Every start is a fresh process, timed from the process's own start (the interpreter's included) to the end of
its first step: lmpipe's from the line its trainer logs then (start-up, compile, first batch wait), the
reference's by the same marks in its child. torch's own cache (TORCHINDUCTOR_CACHE_DIR) is a folder of this
benchmark's, emptied first, one for lmpipe's starts and one for the reference's; "another host" empties it.
Writes bench/results/warm-start-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import WIKITEXT, free_port_pair, smoke_out, table, write_result
from bench.trainbench import bench_data

# uncompiled (--smoke), the line says "step" where a compile's time would be
LINE = re.compile(r"first step after ([\d.]+) s: start-up ([\d.]+) s, (?:compile|step) ([\d.]+) s.*?first batch wait "
                  r"([\d.]+) s(?:, compile cache (\w+))?")  # fmt: skip
# (loader, start, torch's cache folder, fresh: emptied before, checkpoint folder, --resume auto)
LMPIPE_STARTS = (
    ("cold start", "lmpipe", True, "ck", False),
    ("warm restart (--resume auto after kill -9)", "lmpipe", False, "ck", True),
    ("warm restart on another host (torch's local cache empty)", "lmpipe-other", True, "ck", True),
    ("second fresh run (new --checkpoint-dir)", "lmpipe", False, "ck2", False),
)
REFERENCE_STARTS = (
    ("cold start", "reference", True),
    ("second run (a restart: torch's local cache)", "reference", False),
    ("restart on another host (torch's local cache empty)", "reference-other", True),
)


def env_for(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_") and k != "TRITON_CACHE_DIR"}
    return env | {
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def torch_cache(a, name: str, fresh: bool) -> Path:
    path = Path(a.work) / "warm-start" / name
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def lmpipe_start(a, cache: Path, ck: Path, resume: bool, kill_after_checkpoint: bool) -> dict:
    """One `lmpipe run` until its first step's line (a cold start: until its first checkpoint), then kill -9."""
    cmd = [sys.executable, "-m", "lmpipe", "run", "--data", *a.text, "--tokenizer", a.tok, "--model", a.model,
           "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--producers", str(a.workers),
           "--shuffle-window", "1000", "--steps", "1000000", "--log-every", "10", "--checkpoint-dir", str(ck),
           "--checkpoint-every", str(a.checkpoint_every), "--metrics-port", "-1", "--port", str(free_port_pair()),
           "--device", a.device, *(["--compile", "--compile-scope", a.compile_scope] if a.compile else []),
           *(["--resume", "auto"] if resume else [])]  # fmt: skip
    log = Path(a.work) / "warm-start" / "run.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env_for(cache), start_new_session=True
        )
        try:
            found, seen = _wait(p, log, ck, kill_after_checkpoint, t0, a.timeout)
        finally:
            if p.poll() is None:
                os.killpg(
                    p.pid, signal.SIGKILL
                )  # the trainer and its producers, as a node's failure takes them
            p.wait()
    if found is None:
        sys.exit(
            f"lmpipe run: no first step in {a.timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}"
        )
    total, startup, compiled, wait, state = found.groups()
    return {"total": float(total), "startup": float(startup), "compile": float(compiled),
            "first_batch_wait": float(wait), "cache": state or "off", "seen_after": seen}  # fmt: skip


def _wait(p, log: Path, ck: Path, checkpoint: bool, t0: float, timeout: float):
    from lmpipe.consumer.checkpoint import CheckpointManager

    found, seen = None, 0.0
    while time.monotonic() - t0 < timeout and p.poll() is None:
        if found is None and (found := LINE.search(log.read_text(errors="replace"))):
            seen = time.monotonic() - t0
        if found is not None and (not checkpoint or CheckpointManager(ck).latest_step()):
            break
        time.sleep(0.05)
    return found or LINE.search(log.read_text(errors="replace")), seen


def reference_start(a, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.warm_start", "--child", "--text", *a.text, "--tok", a.tok, "--model", a.model,
           "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--workers", str(a.workers),
           "--device", a.device, *([] if a.compile else ["--no-compile"])]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env_for(cache), timeout=a.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"the reference loop failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][7:]) | {"cache": "torch's own", "seen_after": time.monotonic() - t0}


def child(a) -> dict:
    """The reference loop's start: lmpipe's model and step (bench/peers.py ModelStep), a DataLoader, one step."""
    from bench.peers import ModelStep, make_loader
    from lmpipe.consumer.startup import process_age

    started = time.perf_counter() - process_age()
    a.warmup = a.seconds = 0.0
    step = ModelStep(a)  # the model built (and wrapped in torch.compile, which compiles at the first step)
    built = time.perf_counter()
    it = iter(make_loader("dataloader", a.workers, a, epochs=0))
    batch = next(it)
    got = time.perf_counter()
    step(batch)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    done = time.perf_counter()
    del it
    return {"total": done - started, "startup": built - started, "compile": done - got,
            "first_batch_wait": got - built}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4, help="lmpipe's producers and the DataLoader's workers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--compile-scope", default="model", choices=("model", "blocks"), help="lmpipe's")
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="the cold start is killed after this step"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    p.add_argument("--work", default="/tmp/lmpipe-bench", help="tokenizer, caches and checkpoints go here")
    p.add_argument("--out", default=None, help="results directory (default: bench/results)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU, uncompiled: checks the script")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--text", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    if a.smoke:
        a.model, a.seq_len, a.batch_size, a.workers, a.device = "tiny", 64, 4, 1, "cpu"
        a.compile, a.checkpoint_every, a.out = False, 2, smoke_out(a.out)
    a.tok, _ = bench_data(Path(a.work))
    a.text = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    work = Path(a.work) / "warm-start"
    for name in ("ck", "ck2"):
        shutil.rmtree(work / name, ignore_errors=True)
    results: list[tuple[str, str, dict]] = []
    # --smoke: a cold start and its restart, and the reference's cold start (the other starts repeat their code)
    lmpipe_starts, reference_starts = (
        (LMPIPE_STARTS[:2], REFERENCE_STARTS[:1]) if a.smoke else (LMPIPE_STARTS, REFERENCE_STARTS)
    )
    for i, (start, cache, fresh, ck, resume) in enumerate(lmpipe_starts):
        r = lmpipe_start(a, torch_cache(a, cache, fresh), work / ck, resume, kill_after_checkpoint=i == 0)
        results.append(("lmpipe", start, r))
        print(f"lmpipe, {start}: {r}", flush=True)
    for start, cache, fresh in reference_starts:
        r = reference_start(a, torch_cache(a, cache, fresh))
        results.append(("DataLoader reference", start, r))
        print(f"reference, {start}: {r}", flush=True)
    report(a, results)


def report(a, results: list[tuple[str, str, dict]]) -> None:
    ref_cold = next(r["total"] for loader, _, r in results if loader != "lmpipe")
    rows = [[loader, start, r["total"], f"{r['total'] / ref_cold:.2f}x", r["startup"], r["compile"],
             r["first_batch_wait"], r["cache"]] for loader, start, r in results]  # fmt: skip
    lm = {start: r for loader, start, r in results if loader == "lmpipe"}
    warm = lm[LMPIPE_STARTS[1][0]]["total"]
    cold = lm[LMPIPE_STARTS[0][0]]["total"]
    body = (
        f"{a.model}, T={a.seq_len}, {a.batch_size} rows, "
        f"{f'torch.compile (lmpipe: --compile-scope {a.compile_scope})' if a.compile else 'uncompiled'}, "
        f"{a.workers} producers / DataLoader workers, WikiText-2 raw text, on {a.device}. Seconds from each "
        "process's start to the end of its first step; start-up: imports, model, checkpoint (lmpipe: and its "
        "sockets bound); compile: lmpipe's compile cache, the compile ahead and the first step (the reference: "
        "its first step, compiled there); first batch wait: after that, waiting for data (the reference: from "
        "its model built to its first batch, before the compile). Kill -9: the cold start is killed after "
        f"its checkpoint at step {a.checkpoint_every}.\n\n"
        + table(
            [
                "loader",
                "start",
                "first step s",
                "vs reference cold",
                "start-up s",
                "compile s",
                "first batch wait s",
                "compile cache",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nWarm restart: {warm:.1f} s to the first step (target: within 10 s on an H200); cold start: "
        f"{cold / ref_cold:.2f}x the reference's cold start (target: at most 1x).\n"
    )
    print(body)
    write_result("warm-start", "Seconds to the first step: cold, warm restart, second run", body, a.out)


if __name__ == "__main__":
    main()
