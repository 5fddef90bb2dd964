"""Path step-graph: the whole training step as two CUDA graphs, replayed for every batch of the same shapes.

The host takes about as long to issue GPT-2 124M's step (~600 launches) as an H100 takes to run it, so the GPU
waits for it. Replayed, a step costs the host a few copies into static buffers and two replays: 1.14-1.59x at
16 rows on an H100 (bench/results/step-graph-h100-2026-11-27.md). torch's `reduce-overhead` graphs only the
compiled forward and backward and re-records for each batch's new inputs and block mask; here the whole step
is captured once, by hand, as torch's "whole-network capture" recipe does:

- graph 1: forward and backward of the static batch. Gradients start from None when it is captured, so the
  backward writes them into the graph's memory; each replay overwrites them (no accumulation).
- graph 2: grad norm, clip and AdamW over those gradients. The Triton AdamW's address table is built by an
  eager step over the same gradients before capture, so nothing is uploaded inside the graph. lr and the
  loss's denominator are device tensors written before each replay.

Every tensor a graph reads (static inputs, lr, denominator, AdamW's tables, the GEMMs' workspace) is held
here for the graphs' life. Taken only where capture is safe (unavailable): CUDA, one micro-batch a step, no
fp16 loss scaler, no fp8, the Triton AdamW, and batches of one shape (--strategy pack, pad). Anything else
steps eagerly, as does a step whose capture fails (CaptureFailed: said once, nothing lost or trained twice).

Under torchrun, graph 1 holds DDP's bucketed all-reduces too (NCCL ops can be captured), as torch's recipe for
DDP asks: DDP built on the capturing stream, 11 eager steps first, and a capture is collective: every rank
captures at the same step (Dist.all agrees on it) or none does. Opt-in there (`--fast auto,step-graph`) until
it has been measured on several GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.nn.attention.flex_attention import BlockMask

from lmpipe.consumer.fast import cublaslt, memset_nodes, mix
from lmpipe.consumer.fast.names import parse  # torch alone: nvmath, cuda.bindings where used
from lmpipe.consumer.inputs import ModelInputs, document_causal_mask_mod
from lmpipe.consumer.model import AttnSpec
from lmpipe.consumer.step import StepRunner

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

log = logging.getLogger("lmpipe.trainer")
T = TypeVar("T")

# eager steps of one shape before capture: compile, autotuning, the GEMM plans, the allocator's warm-up
GRAPH_AFTER = 3
# under DDP: torch's CUDA-graph notes ask for 11 eager iterations first (DDP's reducer settles its buckets and
# its logging in the first ten)
GRAPH_AFTER_DDP = 11

# the block mask's tensors: torch's own list where it has one (2.13 adds the backward's dq orders)
_MASK_TENSORS: tuple[str, ...] = tuple(getattr(BlockMask, "_TENSOR_ATTRS", (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")))  # fmt: skip


def _tensors(inp: ModelInputs) -> list[torch.Tensor | None] | None:
    """The batch's tensors in a fixed order, or None for a batch a graph cannot replay (varlen offsets
    change length with the documents)."""
    attn = inp.attn
    out: list[torch.Tensor | None] = [inp.idx, inp.pos, inp.targets]
    if attn.kind == "causal":
        return out
    if attn.kind == "dense":
        return [*out, attn.mask]
    if attn.kind == "flex" and attn.seg is not None and isinstance(attn.block_mask, BlockMask):
        return [*out, attn.seg, *(getattr(attn.block_mask, name) for name in _MASK_TENSORS)]
    return None


def shape_key(inp: ModelInputs) -> tuple | None:
    """What a captured graph fixes about a batch: None where it cannot be captured."""
    ts = _tensors(inp)
    if ts is None:
        return None
    return (inp.attn.kind, *((None if t is None else (t.shape, t.dtype, t.device)) for t in ts))


def _static_copy(inp: ModelInputs) -> ModelInputs:
    """Tensors of the batch's shapes that every replay reads; filled by StepGraph.run."""
    idx, pos, targets = inp.idx.clone(), inp.pos.clone(), inp.targets.clone()
    attn = inp.attn
    if attn.kind == "causal":
        return ModelInputs(idx, pos, targets, AttnSpec("causal"))
    if attn.kind == "dense":
        assert attn.mask is not None
        return ModelInputs(idx, pos, targets, AttnSpec("dense", mask=attn.mask.clone()))
    bm = attn.block_mask
    assert isinstance(bm, BlockMask) and attn.seg is not None
    seg = attn.seg.clone()
    parts = {
        name: (None if getattr(bm, name) is None else getattr(bm, name).clone()) for name in _MASK_TENSORS
    }
    if hasattr(bm, "dq_kv_order_spt"):
        parts["dq_kv_order_spt"] = bm.dq_kv_order_spt
    static = BlockMask(seq_lengths=bm.seq_lengths, BLOCK_SIZE=bm.BLOCK_SIZE,
                       mask_mod=document_causal_mask_mod(seg), **parts)  # type: ignore[arg-type]  # fmt: skip
    return ModelInputs(idx, pos, targets, AttnSpec("flex", block_mask=static, seg=seg))


class CaptureFailed(Exception):
    """Something in the step cannot be captured (a host sync, an uncapturable library call). `result`: the
    batch's (loss, norm) where it trained before the failure, else None (it has not trained)."""

    def __init__(self, error: BaseException, result: tuple[torch.Tensor, torch.Tensor] | None):
        # an invalidated capture's error comes from capture_end, raised while the real cause was handled
        cause = error.__context__ if isinstance(error.__context__, Exception) else error
        super().__init__(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        self.result = result


class StepGraph:
    """The runner's step for batches of one shape, captured at construction (which also trains on `inp`)."""

    def __init__(self, runner: StepRunner, inp: ModelInputs, denom: float, lr: float):
        if why := _gemm_problem():  # refused before anything is captured or changed
            raise CaptureFailed(ValueError(why), None)
        self.key = shape_key(inp)
        self.optimizer = opt = runner.optimizer  # not the runner: it holds this graph (no reference cycle)
        device = inp.idx.device
        self.static = _static_copy(inp)
        self.denom = torch.full((), denom, device=device)
        self.lr = torch.full((), lr, dtype=torch.float32, device=device)
        # the eager steps' cached blocks back to the driver: the graph's pool holds a step's activations of its own
        torch.cuda.empty_cache()
        # DDP's stream where there is one: its reducer's gradient accumulators were made there (consumer/build.py)
        side = runner.capture_stream or torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # torch's rule: warm up on the stream that captures
            runner.forward_backward(self.static, self.denom, cache=False)
            opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        rewrite = getattr(runner, "rewrite_memsets", False)
        self.fwd_bwd = _graph(rewrite)
        try:
            self.loss = _capture(
                self.fwd_bwd,
                side,
                pool,
                lambda: runner.forward_backward(self.static, self.denom, cache=False),
            )
            _finish(self.fwd_bwd, device, rewrite)
        except Exception as e:  # nothing ran: the gradients made in the capture are not this batch's
            opt.zero_grad(set_to_none=True)
            raise CaptureFailed(e, None) from e
        self.fwd_bwd.replay()  # this batch's gradients, now in the graph's memory
        for g in opt.param_groups:
            g["lr"] = self.lr  # the Triton AdamW reads it from memory (consumer/fast/adamw.py)
        try:
            # the update for this batch, eager: it builds AdamW's tables over the graph's gradients
            norm = runner.clip_and_update()
            self.first = (self.loss.detach().clone(), norm)
            side.wait_stream(torch.cuda.current_stream(device))
            self.update = _graph(rewrite)
            try:
                self.norm = _capture(self.update, side, pool, runner.clip_and_update)
                _finish(self.update, device, rewrite)
            except Exception as e:  # this batch has trained (above): its result stands
                torch.cuda.current_stream(device).wait_stream(side)
                opt.zero_grad(set_to_none=True)
                raise CaptureFailed(e, self.first) from e
            torch.cuda.current_stream(device).wait_stream(side)
        finally:
            for g in opt.param_groups:
                g["lr"] = lr  # the graph holds self.lr's address; param_groups (checkpoints) keep a float
        # what the graphs read by address and nothing else holds for good
        tables = getattr(opt, "_tables", {})
        self._keep = [t for _, t in tables.values()] + list(cublaslt._workspaces.values())
        log.info("the training step runs as CUDA graphs from here (--fast step-graph)")

    def takes(self, inp: ModelInputs) -> bool:
        return shape_key(inp) == self.key

    def run(self, inp: ModelInputs, denom: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        for dst, src in zip(_tensors(self.static) or [], _tensors(inp) or []):
            if dst is not None and src is not None:
                dst.copy_(src, non_blocking=True)
        self.denom.fill_(denom)
        self.lr.fill_(lr)
        for g in self.optimizer.param_groups:
            g["lr"] = lr  # as the eager step leaves it, for whoever reads param_groups
        self.fwd_bwd.replay()
        self.update.replay()
        return self.loss.detach(), self.norm


def _graph(rewrite: bool) -> torch.cuda.CUDAGraph:
    """A graph to capture into; kept un-instantiated after capture where its memset nodes are to be
    rewritten (consumer/fast/memset_nodes.py)."""
    if not rewrite:
        return torch.cuda.CUDAGraph()
    return torch.cuda.CUDAGraph(keep_graph=True)


def _finish(graph: torch.cuda.CUDAGraph, device: torch.device, rewrite: bool) -> None:
    """The captured graph's memset nodes as kernel nodes, then instantiated (where _graph kept it so; a
    failed instantiation fails the capture, as it does inside capture_end)."""
    if not rewrite:
        return
    try:
        n = memset_nodes.rewrite(graph, device)
    except Exception as e:  # the graph is still correct, part-edited: it runs as it stands
        log.warning("the step graph keeps its memset nodes (%s: %s)", type(e).__name__, e)
    else:
        log.debug("the step graph's %d memset nodes run as kernel nodes", n)
    graph.instantiate()


def _capture(graph: torch.cuda.CUDAGraph, side: torch.cuda.Stream, pool, fn: Callable[[], T]) -> T:
    """fn() captured into `graph` on stream `side`, its memory from `pool`. A failed capture leaves neither
    the current stream, the allocator nor the RNG in capture mode: torch.cuda.graph's exit restores the
    stream only after capture_end succeeds, and the allocator, while it thinks a capture is under way, frees
    no block that another stream used (record_stream: the feed's every batch) until the process ends."""
    prev = torch.cuda.current_stream(side.device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side):
            return fn()
    except Exception:
        torch.cuda.set_stream(prev)
        try:
            torch._C._cuda_endAllocateToPool(side.device.index, pool)
        except Exception:
            pass  # capture_end got that far: the graph ended the capture and gives its pool back itself
        else:  # it did not: nothing else gives back the pool's use that the capture took
            torch._C._cuda_releasePool(side.device.index, pool)
        # nor did it end the CUDA RNG's capture mode, in which every later random op (dropout) raises: the
        # generator goes on from a copy of its state, out of that mode
        gen = torch.cuda.default_generators[side.device.index or 0]
        gen.graphsafe_set_state(gen.clone_state())
        raise


def _gemm_problem() -> str | None:
    """Why nvmath's GEMMs (consumer/fast/cublaslt.py) would fail a capture, or None: only the direct cuBLASLt call
    can be captured (Matmul.execute() records an event of its own)."""
    if not cublaslt._plans:
        return None
    if not cublaslt.DIRECT:
        return "nvmath's GEMMs run through Matmul.execute(), which cannot be captured"
    if not all(cublaslt._direct_ok(mm) for mm in cublaslt._plans.values()):
        return "this nvmath-python's planned GEMMs lack what the direct cuBLASLt call reads (nvmath 1.0's)"
    return None


class GraphedSteps(StepRunner):
    """The runner's step as CUDA graphs once a shape has repeated; eager until then, and for other shapes."""

    rewrite_memsets = False  # consumer/fast/memset_nodes.py sets it
    _graph: StepGraph | None = None
    _eager_steps = 0
    _last_key: tuple | None = None

    def step(self, micro: list[ModelInputs], denom: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        denom = denom if denom > 0 else 1.0
        if self.graphs and len(micro) == 1:
            graph = self._graph
            if graph is not None and graph.takes(micro[0]):
                return graph.run(micro[0], denom, lr)
            key = shape_key(micro[0])
            if graph is None and (key is not None or self.all_ranks is not None):
                # steps in a row of this shape: a graph is made for the shape the run keeps, not a short batch's
                if key is not None:
                    self._eager_steps = self._eager_steps + 1 if key == self._last_key else 1
                    self._last_key = key
                after = GRAPH_AFTER if self.no_sync is None else GRAPH_AFTER_DDP
                ready = key is not None and self._eager_steps > after
                # a capture holds NCCL's all-reduces: every rank asks at every step until the capture, and
                # all capture at the same step or none does
                if self.all_ranks is not None:
                    ready = self.all_ranks(ready)
                if ready:  # compiled, tuned and planned by now: capture
                    try:
                        self._graph = StepGraph(self, micro[0], denom, lr)
                        return self._graph.first
                    except CaptureFailed as e:  # the same step fails the same way: eager from here on
                        self.graphs = False
                        # its text, not the exception: a handler that keeps records (pytest's caplog, a
                        # buffer) would keep the traceback, and with it the failed capture's tensors
                        log.warning("the training step cannot be captured as CUDA graphs (%s); it runs "
                                    "eagerly from here (--fast auto,-step-graph: no attempt)", str(e))  # fmt: skip
                        if e.result is not None:
                            return e.result
        if self._graph is not None:  # the graph's gradients stay in p.grad; an eager backward starts anew
            self.optimizer.zero_grad(set_to_none=True)
        return super().step(micro, denom, lr)


def unavailable(built: Built) -> str | None:
    """Why the step cannot be captured in this build, or None."""
    runner, cfg = built.runner, built.tcfg
    if runner.no_sync is not None and cfg.grad_reduce == "bf16":
        return "--grad-reduce bf16's hook finishes DDP's all-reduce on the host"
    if runner.no_sync is not None and runner.capture_stream is None:
        return "DDP was built without a capture stream (not on CUDA)"
    if runner.no_sync is not None and "step-graph" not in parse(cfg.fast).add:
        return "under torchrun it is opt-in until measured on several GPUs (--fast auto,step-graph)"
    if runner.scaler is not None:
        return "fp16's loss scaler decides on the host whether to step"
    if cfg.attention == "flash":
        return "--attention flash's document offsets change length from batch to batch"
    if cfg.fused_ce:
        return "--fused-ce (liger) reads the loss on the host every step"
    if cfg.precision == "fp8":
        return "torchao's float8 matmuls have not been run under CUDA graph capture here yet"
    if runner.cudagraphs:
        return f"--compile-mode {cfg.compile_mode} records CUDA graphs of its own"
    if runner.strategy not in ("pack", "pad"):
        # one graph holds its own activations: eager steps for the other shapes beside it would double them
        return f"--strategy {runner.strategy} changes the batches' shape from step to step"
    if cfg.accum != 1:
        return "it captures one micro-batch a step (--accum 1)"
    if "adamw" not in built.fast:
        return "it needs the Triton AdamW (path adamw), which reads lr from memory"
    return None


def apply(built: Built) -> None:
    mix(built.runner, GraphedSteps)
    built.runner.graphs = True
    # autocast's cache as a capture has it, for the whole run: dynamo guards on it (one compile, not two)
    built.runner.autocast_cache = False
