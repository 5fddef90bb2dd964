"""The trainer's way to its first step, and how long each part took.

Between the process's start and its first step a --compile run does, in order: imports, the model build and
the checkpoint load (start-up), binding the sockets (producers connect and fill the slots from here on), the
compile cache (consumer/compile_cache.py) and the compile, then the first batch. The compile does not need
a batch: with --compile-ahead (the default) it runs on a blank batch of the run's one shape while the
producers connect, tokenize and fill the slots, so that the first real batch is waiting when it is done.

Startup holds the cache and the marks, and says the split once the first step is done: in a log line, and in
the summary (Summary.first_step_split, `--summary-json`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmpipe.consumer.compile_cache import CompileCache, environment, place
from lmpipe.consumer.fast import cublaslt
from lmpipe.consumer.hf import model_identity
from lmpipe.consumer.inputs import MaskCache, ModelInputs, build_inputs
from lmpipe.consumer.report import Announce, Summary
from lmpipe.shared.batch import token_dtype

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.distributed import Dist
    from lmpipe.consumer.step import StepRunner
    from lmpipe.shared.config import PipelineConfig

log = logging.getLogger("lmpipe.trainer")


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), 0.0 where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


def cache_key(
    pcfg: PipelineConfig, tcfg: TrainConfig, model: dict[str, Any], device: torch.device, precision: str,
    fast: list[str], world_size: int,
) -> dict[str, Any]:  # fmt: skip
    """What a compiled graph depends on: the software and card (environment), the model, and the settings
    that change what is traced or how it is compiled. Learning rate, steps and the like change no graph."""
    return {
        **environment(device),
        **({"nvmath": _nvmath()} if device.type == "cuda" else {}),
        "model": tcfg.model,
        "model_config": model,
        "precision": precision,
        "compile_mode": tcfg.compile_mode,
        "compile_scope": tcfg.compile_scope,
        "attention": tcfg.attention,
        "hf_attention": tcfg.hf_attention,
        "fused_ce": tcfg.fused_ce,
        "residual_dtype": tcfg.residual_dtype,
        "grad_checkpointing": tcfg.grad_checkpointing,
        "fused_adamw": tcfg.fused_adamw,
        "fast": list(fast),
        "strategy": pcfg.strategy,
        "seq_len": pcfg.seq_len,
        "batch_size": pcfg.batch_size,
        "pad_multiple": pcfg.pad_multiple,
        "world_size": world_size,
    }


def _nvmath() -> str:
    try:
        from importlib.metadata import version

        return version("nvmath-python")
    except Exception:
        return "none"


def ahead_possible(pcfg: PipelineConfig, tcfg: TrainConfig, distributed: bool) -> bool:
    """Compile ahead only where the first batch's shape is known (pack, pad: every batch is [rows, seq_len]),
    and in one process (under torchrun, DDP's backward is a collective every rank must reach together)."""
    return tcfg.compile and tcfg.compile_ahead and pcfg.strategy in ("pack", "pad") and not distributed


def blank_inputs(pcfg: PipelineConfig, vocab_size: int, device: torch.device, attention: str) -> ModelInputs:
    """A batch of the run's shape and dtypes, made as consumer/feed.py makes a real one from a host slot (the
    same conversions, the block mask from a host copy of seg on CUDA), so that the graph compiled on it is
    the one the real batches run: one document of zeros per row, every token a target."""
    B, T = pcfg.batch_size, pcfg.seq_len
    tdt = torch.uint16 if token_dtype(vocab_size) == np.dtype("<u2") else torch.int32
    tokens = torch.zeros(B, T, dtype=tdt)
    lengths = torch.full((B,), T, dtype=torch.int32)
    seg = torch.zeros(B, T, dtype=torch.uint16) if pcfg.strategy == "pack" else None
    seg_host = None
    if device.type == "cuda":
        seg_host = None if seg is None else seg.numpy()
        tokens, lengths = tokens.to(device), lengths.to(device)
        seg = None if seg is None else seg.to(device)
    else:
        tokens, seg = tokens.to(torch.int64), None if seg is None else seg.to(torch.int32)
    return build_inputs(tokens, lengths, seg, attention=attention, mask_cache=MaskCache(), seg_host=seg_host)


def compile_ahead(runner: StepRunner, inputs: ModelInputs, device: torch.device) -> None:
    """Trace and compile forward and backward on `inputs`; the gradients are dropped and no optimizer step
    is taken: the weights, the optimizer's state and the RNG's draws stay as they were."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    runner.model.train()
    if runner.cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    runner.forward_backward(inputs, 1.0, cache=runner.autocast_cache)
    runner.optimizer.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.synchronize(device)
        torch.cuda.set_rng_state(cuda_rng, device)


def uncached_bytecode(module_file: str | None = None) -> str | None:
    """Why every start of this process compiles torch's Python source again (no .pyc to read, none written),
    or None. On one H200 host that set PYTHONDONTWRITEBYTECODE with a torch installed without bytecode, it
    was 10-15 s of each start (bench/results/startup-profile-h200-2026-11-28.md)."""
    try:
        source = module_file or torch.__file__ or ""
        cached = importlib.util.cache_from_source(source)  # honours PYTHONPYCACHEPREFIX
    except (NotImplementedError, ValueError):
        return None
    if os.path.exists(cached):
        return None
    folder = os.path.dirname(cached)
    while folder and not os.path.isdir(folder):  # the __pycache__ (or prefix) folder may not exist yet
        folder = os.path.dirname(folder)
    if not sys.dont_write_bytecode and os.access(folder, os.W_OK):
        return None  # written by this start, read by the next
    torch_dir = os.path.dirname(source)
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else f"{folder} is not writable"
    return (f"torch's modules have no compiled bytecode here and {why}: every start compiles them again "
            f"(10-15 s before the first step); compile them once (python -m compileall -q {torch_dir}) or "
            "point PYTHONPYCACHEPREFIX at a writable folder")  # fmt: skip


class Startup:
    """The trainer's way to its first step: the compile cache (opened once the sockets are bound), the compile
    ahead, and the marks (time.perf_counter()) that give the split of the time to the first step."""

    def __init__(self) -> None:
        now = time.perf_counter()
        self.process_start = now - process_age()  # the trainer's own start where /proc cannot say
        self.bound = self.ready = now  # the sockets bound (producers connect); the compile ahead done
        self.graphs_ready = 0  # graphs compiled in this process when the compile ahead was done
        self.ahead = False  # whether the model was compiled ahead
        self.done: float | None = None  # the first step's end
        self.cache = CompileCache(None, {})  # off until built() says what there is to compile
        self._runner: StepRunner | None = None
        self._blank: Callable[[], ModelInputs] | None = None

    def built(
        self, pcfg: PipelineConfig, tcfg: TrainConfig, built: Built, dist: Dist, vocab_size: int
    ) -> None:
        """What build() made: the cache's key (--compile), and what a compile ahead needs."""
        if dist.is_main and (why := uncached_bytecode()):
            log.warning("%s", why)
        if tcfg.compile:  # a cache with a key, even where it is off: the start says which
            folder = place(tcfg.compile_cache, tcfg.checkpoint_dir)
            model = model_identity(built.model)
            key = cache_key(pcfg, tcfg, model, built.device, built.precision, built.fast, dist.world_size)
            self.cache = CompileCache(folder, key, writer=dist.is_main)
        if ahead_possible(pcfg, tcfg, dist.enabled):
            self._runner = built.runner
            self._blank = lambda: blank_inputs(pcfg, vocab_size, built.device, tcfg.attention)

    def warm_up(self) -> None:
        """Once the sockets are bound, while producers connect and fill the slots: the compile cache opened
        (one line: warm or not, and why), and the model compiled on a blank batch (--compile-ahead)."""
        self.bound = time.perf_counter()
        if self.cache.key:
            self.cache.open()
            cublaslt.load_picks(self.cache.plans)
        if self._runner is not None and self._blank is not None:
            with Announce("compiling the model (torch.compile, first step)", log):
                compile_ahead(self._runner, self._blank(), next(self._runner.model.parameters()).device)
            self.ahead = True
        self.ready = time.perf_counter()
        self.graphs_ready = _graphs()

    def first_step_done(self, summary: Summary, run_start: float | None, compiled: bool, step: int,
                        say: bool) -> None:  # fmt: skip
        """The first step is done (synced): keep the split in the summary, say it (`say`: rank 0), and save
        what compiled."""
        self.done = time.perf_counter()
        first_step = self.done - (run_start if run_start is not None else self.ready)
        summary.first_step_split = {
            "total": self.done - self.process_start,
            "startup": self.bound - self.process_start,  # imports, model, checkpoint, sockets bound
            "compile": (self.ready - self.bound + first_step) if compiled else 0.0,  # cache, ahead, step 1
            "first_batch_wait": summary.first_data_wait_seconds,  # the step loop's wait, after the compile
            "first_step": 0.0 if compiled else first_step,  # uncompiled: the step's own time
            "compiled_ahead": self.ahead,
            # graphs the first step compiled after the compile ahead: 0 when the ahead one served it
            "first_step_recompiles": _graphs() - self.graphs_ready if self.ahead else None,
            "compile_cache": self.cache.state,
            # torch's own cache lookups (inductor's FX graphs, AOTAutograd's), local or loaded from this cache
            "compile_cache_hits": _counter("inductor", "fxgraph_cache_hit")
            + _counter("aot_autograd", "autograd_cache_hit"),
            "compile_cache_misses": _counter("inductor", "fxgraph_cache_miss")
            + _counter("aot_autograd", "autograd_cache_miss"),
        }
        if say:
            log.info("%s", say_split(summary.first_step_split))
        self.save(step)

    def save(self, step: int) -> None:
        """Save what this process compiled (torch's artifacts and the cuBLASLt picks), if there is more than
        the cache holds: after the first step, and at the end (graphs compiled since: another batch shape)."""
        if self.cache.key:
            self.cache.save(_graphs(), plans=cublaslt.picks(), step=step)


def _counter(group: str, name: str) -> int:
    return int(torch._dynamo.utils.counters[group][name])


def _graphs() -> int:
    """Graphs torch.compile compiled in this process so far."""
    return _counter("stats", "unique_graphs")


def say_split(split: dict[str, Any]) -> str:
    """The one line the trainer logs at its first step."""
    cache = f", compile cache {split['compile_cache']}" if split["compile_cache"] != "off" else ""
    again = split.get("first_step_recompiles") or 0  # the first batch's graph was not the one made ahead
    return (
        f"first step after {split['total']:.1f} s: start-up {split['startup']:.1f} s, "
        + (f"compile {split['compile']:.1f} s" if split["compile"] else f"step {split['first_step']:.1f} s")
        + f"{' (ahead, while producers connected)' if split['compiled_ahead'] else ''}, "
        f"first batch wait {split['first_batch_wait']:.1f} s{cache}"
        + (f"; the first step compiled {again} more graph(s) than the one made ahead" if again else "")
    )
