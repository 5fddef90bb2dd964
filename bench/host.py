"""Probe: is the step host-bound? The host's time to issue one training step, against the GPU's time to run it.

A step is host-bound when the Python that issues it (compiled graphs' wrappers, custom ops, nvmath's and
Triton's launchers, the optimizer, the batch's block mask) takes longer than the GPU's kernels: the GPU
then waits between them, and GPU-side savings do not show in tokens/s. Each measured step here starts behind
a long GPU sleep, so the host never waits for the GPU while it issues the step: the host time is the time to
return, the GPU time is CUDA events around the step's kernels (after the sleep). The host time is then split
by part (the block mask, the compiled forward, backward, grad norm, optimizer, and nvmath's GEMM calls inside
the forward and backward) with timers around those functions, and one nvmath GEMM call is set against one
torch.mm of the same shape. Then cProfile over a few such steps names the host-side functions that cost most.

    python -m bench.host [--batch-size 32] [--compile-mode autotune-attention]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

import bench.trainbench
from bench.common import table, write_result
from bench.trainbench import SyntheticSteps, apply_smoke, common_args, warm_synthetic_steps
from lmpipe.consumer.fast import cublaslt

# (part, is it inside the forward or backward): the parts that are not add up to the step, with the rest
PARTS = [
    ("inputs and block mask", False),
    ("forward (compiled graph, custom ops)", False),
    ("backward (compiled graph, custom ops)", False),
    ("grad norm", False),
    ("optimizer step", False),
    ("nvmath GEMM calls", True),
]


QUEUED = 4  # steps issued behind one GPU sleep


class _TimedModule:
    """The step's model with its calls timed; everything else (train(), parameters()) passes through."""

    def __init__(self, module, timed: Callable):
        self._module, self._timed = module, timed

    def __call__(self, *args, **kwargs):
        return self._timed(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


@contextlib.contextmanager
def timed_parts(step: SyntheticSteps) -> Iterator[dict[str, float]]:
    """Host seconds spent in each of PARTS while the block runs, summed over its steps."""
    spent: dict[str, float] = defaultdict(float)

    def timer(part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0

        return timed

    runner = step.trainer.runner
    names = [p for p, _ in PARTS]
    # module attributes the step looks up at call time, so a patch here is seen there
    patches = [
        (bench.trainbench, "build_inputs", names[0]),
        (torch.autograd, "backward", names[2]),
        (torch.nn.utils, "get_total_norm", names[3]),
        (cublaslt, "gemm", names[5]),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    model, opt = runner.model, runner.optimizer
    own_step = vars(opt).get(
        "step"
    )  # an instance attribute of its own (a scheduler's wrapper), put back after
    try:
        for obj, attr, part in patches:
            setattr(obj, attr, timer(part, getattr(obj, attr)))
        runner.model = _TimedModule(model, timer(names[1], model))
        opt.step = timer(names[4], opt.step)
        yield spent
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
        runner.model = model
        if own_step is not None:
            opt.step = own_step
        else:
            vars(opt).pop("step", None)


def gemm_call_cost(n: int, k: int, m: int, calls: int = 50) -> tuple[float, float] | None:
    """Host microseconds of one nvmath GEMM call (consumer/fast/cublaslt.py) and of one torch.mm, [n, k] x [k, m]
    in bf16 (the LM head's shape at the step's rows), each run of calls issued behind a GPU sleep; None
    without nvmath."""
    if cublaslt.nvmath_missing():
        return None
    a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).t()
    cublaslt.gemm(a, b)  # plans (and times) the shape once
    torch.cuda.synchronize()
    costs = []
    for fn in (cublaslt.gemm, torch.mm):
        torch.cuda._sleep(int(1e9))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(a, b)
        costs.append(1e6 * (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return costs[0], costs[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(p)
    p.set_defaults(model="gpt2-124m", seq_len=1024, batch_size=32, warmup=15, steps=10)
    p.add_argument("--top", type=int, default=30, help="host functions listed (cProfile, cumulative)")
    args = apply_smoke(p.parse_args())
    # the step as the host issues it: a replayed graph calls none of the functions timed here
    step = warm_synthetic_steps(args, fast="auto,-step-graph")
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
    # steps queued behind one long sleep: the GPU runs them back to back whatever the host does meanwhile, so
    # their per-step GPU time against the back-to-back run below says whether the host or the GPU (its
    # clocks under load) makes the difference
    queued: list[float] = []
    ahead = []
    for r in range(3):
        torch.cuda._sleep(int(4e9))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(QUEUED + 1)]
        events[0].record()
        for j in range(QUEUED):
            step(args.warmup + r * QUEUED + j)
            events[j + 1].record()
        ahead.append(
            not events[0].query()
        )  # all issued before the sleep ended (events[0] comes right after it)
        torch.cuda.synchronize()
        queued += [events[j].elapsed_time(events[j + 1]) for j in range(QUEUED)]
    with timed_parts(step) as spent:
        split = [behind_a_sleep(args.warmup + i) for i in range(args.steps)]
    split_host = sum(h for h, _ in split) / len(split)
    part_ms = {part: 1e3 * spent[part] / len(split) for part, _ in PARTS}
    rest = split_host - sum(part_ms[part] for part, inner in PARTS if not inner)
    part_rows = [
        [part + (" (inside the two above)" if inner else ""), part_ms[part]] for part, inner in PARTS
    ]
    part_rows.append(["the rest (the step's own Python, autocast, loss sum, lr)", rest])
    part_rows.append(["host total, these steps' mean (the timers' own cost included)", split_host])
    head_cost = gemm_call_cost(args.batch_size * args.seq_len, step.trainer.model.config.n_embd,
                               step.trainer.model.config.vocab_size)  # fmt: skip
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
        + f"\n\n{QUEUED} steps queued behind one GPU sleep, 3 times: GPU ms a step by CUDA events median "
        f"{statistics.median(queued):.2f} (min {min(queued):.2f}, max {max(queued):.2f}); the host had issued "
        f"them all before the sleep ended in {sum(ahead)} of 3."
        + "\n\nHost ms a step by part (timers around the functions the step calls; means):\n\n"
        + table(["part", "host ms a step"], part_rows)
        + (
            f"\n\nOne LM-head GEMM ({args.batch_size * args.seq_len} x {step.trainer.model.config.n_embd} by "
            f"{step.trainer.model.config.n_embd} x {step.trainer.model.config.vocab_size}, bf16), host "
            f"microseconds a call: nvmath {head_cost[0]:.1f}, torch.mm {head_cost[1]:.1f}."
            if head_cost
            else ""
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
