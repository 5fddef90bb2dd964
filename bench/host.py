"""Probe: is the step host-bound? The host's time to issue one training step, against the GPU's time to run it.

A step is host-bound when the Python that issues it (compiled graphs' wrappers, custom ops, nvmath's and
Triton's launchers, the optimizer, the batch's block mask) takes longer than the GPU's kernels: the GPU
then waits between them, and GPU-side savings do not show in tokens/s. Each measured step here starts behind
a long GPU sleep, so the host never waits for the GPU while it issues the step: the host time is the time to
return, the GPU time is CUDA events around the step's kernels (after the sleep). Then cProfile over a few
such steps names the host-side functions that cost most.

    python -m bench.host [--batch-size 32] [--compile-mode autotune-attention]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import subprocess
import time

import torch

from bench.common import table, write_result
from bench.trainbench import apply_smoke, common_args, warm_synthetic_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(model="gpt2-124m", seq_len=1024, batch_size=32, warmup=15, steps=10)
    p.add_argument("--top", type=int, default=30, help="host functions listed (cProfile, cumulative)")
    args = apply_smoke(p.parse_args())
    step = warm_synthetic_steps(args)
    tcfg = step.tcfg

    def behind_a_sleep(i: int) -> tuple[float, float]:
        torch.cuda._sleep(int(1.5e9))  # about a second of GPU cycles: the host issues the step unhindered
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step(i)
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        return 1e3 * host, start.elapsed_time(end)

    times = [behind_a_sleep(args.warmup + i) for i in range(args.steps)]
    host = statistics.median(h for h, _ in times)
    gpu = statistics.median(g for _, g in times)
    # the same steps back to back, as training runs them, with the SM clock and power sampled meanwhile
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active", "--format=csv,noheader,nounits",
         "-lms", "100", "-i", str(torch.cuda.current_device())],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.5)
    n_run = 3 * args.steps
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n_run + 1)]
    t0 = time.perf_counter()
    events[0].record()
    for i in range(n_run):
        step(args.warmup + args.steps + i)
        events[i + 1].record()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / n_run
    smi.terminate()
    samples = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    per_step = [events[i].elapsed_time(events[i + 1]) for i in range(n_run)]
    busy = [(float(c), float(w), r) for c, w, r in samples if float(w) > 200]  # the samples while training
    clocks = statistics.median(c for c, _, _ in busy) if busy else float("nan")
    power = statistics.median(w for _, w, _ in busy) if busy else float("nan")
    reasons = sorted({r for _, _, r in busy})
    prof = cProfile.Profile()
    n_prof = 3
    for i in range(n_prof):
        torch.cuda._sleep(int(1.5e9))
        prof.enable()
        step(args.warmup + args.steps + i)
        prof.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    body = (
        f"{args.model}, T={args.seq_len}, {args.batch_size} rows, compile mode {tcfg.compile_mode}; "
        f"synthetic-fed; {args.steps} steps each behind a GPU sleep (medians).\n\n"
        + table(
            ["host ms to issue a step", "GPU ms to run it", "host / GPU"],
            [[host, gpu, host / gpu]],
        )
        + f"\n\n{n_run} steps back to back: {wall:.2f} ms a step by the wall clock, by CUDA events median "
        f"{statistics.median(per_step):.2f} ms (min {min(per_step):.2f}, max {max(per_step):.2f}); while they "
        f"ran, nvidia-smi every 100 ms ({len(busy)} samples over 200 W): SM clock median {clocks:.0f} MHz, "
        f"power median {power:.0f} W, clock event reasons seen {reasons}.\n"
        + f"\n\nHost functions over {n_prof} steps (cProfile, which slows the host; cumulative seconds):\n\n```\n"
        + out.getvalue().strip()
        + "\n```\n"
    )
    print(body)
    write_result(
        "host", "Is the step host-bound? Host time to issue a step against GPU time to run it", body, args.out
    )


if __name__ == "__main__":
    main()
