"""Path memset-nodes: a captured CUDA graph's memset nodes rewritten as kernel nodes (the step graph's,
consumer/fast/step_graph.py).

cuBLASLt zeroes 4 bytes of its workspace before every GEMM that uses one. Captured, each is a memset node,
and the GPU sits idle for microseconds around it where one kernel follows another in about 0.5 us. Without a
workspace there are no memsets, but the small weight gradients lose split-K (0.93x,
bench/results/workspace-2026-11-28.md). So the memsets stay, as kernel nodes that store the same bytes: same
place in the graph, same edges. 1.002x in the step on an H200, within noise: opt-in
(bench/results/memset-nodes-h200-2026-11-28.md).

CUDA's driver API through cuda-python (`cuda.bindings`, which nvmath-python already brings) does the
editing; torch exposes the graph (`CUDAGraph(keep_graph=True).raw_cuda_graph()`) but no way to edit it. The
kernel is a few lines of PTX, loaded by the driver: no compiler at run time.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

THREADS = 256

# dst[i] = value for i < count (32-bit words); one thread a word
_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry lmpipe_fill_u32(.param .u64 dst, .param .u32 value, .param .u32 count)
{
    .reg .pred %p<2>;
    .reg .b32 %r<7>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [dst];
    ld.param.u32 %r1, [value];
    ld.param.u32 %r2, [count];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r6, %r2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r6, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r1;
DONE:
    ret;
}
\x00"""


@dataclass(frozen=True)
class Fill:
    """A memset as 32-bit stores: `count` words of `word` from `dst`."""

    dst: int
    word: int
    count: int


def as_words(dst: int, value: int, element_size: int, width: int, height: int) -> Fill | None:
    """The 1-D memset (`width` elements of `element_size` bytes, each `value`) as 32-bit stores, or None
    where it is not one (2-D, or not whole aligned words): such a node is left as it is."""
    if height != 1 or element_size not in (1, 2, 4) or width <= 0:
        return None
    size = width * element_size
    if dst % 4 or size % 4 or size // 4 >= 2**31:
        return None
    bits = 8 * element_size
    v = value & ((1 << bits) - 1)
    word = v * {1: 0x01010101, 2: 0x00010001, 4: 1}[element_size]
    return Fill(dst, word, size // 4)


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err.name}")
    return rest[0] if len(rest) == 1 else rest


@functools.cache
def _function(device_index: int):
    """The fill kernel, loaded into the context current on this thread: torch's, which the capture used."""
    from cuda.bindings import driver

    module = _check(driver.cuModuleLoadData(_PTX))
    return module, _check(driver.cuModuleGetFunction(module, b"lmpipe_fill_u32"))


def _kernel_params(fn, fill: Fill):
    from cuda.bindings import driver

    p = driver.CUDA_KERNEL_NODE_PARAMS()
    p.func = fn
    p.gridDimX, p.gridDimY, p.gridDimZ = (fill.count + THREADS - 1) // THREADS, 1, 1
    p.blockDimX, p.blockDimY, p.blockDimZ = min(THREADS, 32 * ((fill.count + 31) // 32)), 1, 1
    p.sharedMemBytes = 0
    p.kernelParams = ((fill.dst, fill.word, fill.count), (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32))
    p.extra = 0
    return p


def rewrite(graph: torch.cuda.CUDAGraph, device: torch.device) -> int:
    """Every 1-D memset node of `graph` (captured with keep_graph=True, not yet instantiated) replaced by a
    kernel node with the same edges; the number replaced. Raises where the driver refuses an edit; the graph
    is then part-edited and still correct (a memset and its kernel may both be in it)."""
    from cuda.bindings import driver

    g = driver.CUgraph(graph.raw_cuda_graph())
    n = _check(driver.cuGraphGetNodes(g, 0))[1]
    nodes = _check(driver.cuGraphGetNodes(g, n))[0]
    kinds = [_check(driver.cuGraphNodeGetType(node)) for node in nodes]
    T = driver.CUgraphNodeType
    if T.CU_GRAPH_NODE_TYPE_MEM_ALLOC in kinds or T.CU_GRAPH_NODE_TYPE_MEM_FREE in kinds:
        return 0  # the driver destroys no node of such a graph (cudaMallocAsync's)
    fn = None
    done = 0
    for node, kind in zip(nodes, kinds):
        if kind != T.CU_GRAPH_NODE_TYPE_MEMSET:
            continue
        m = _check(driver.cuGraphMemsetNodeGetParams(node))
        fill = as_words(int(m.dst), int(m.value), int(m.elementSize), int(m.width), int(m.height))
        if fill is None:
            continue
        if fn is None:
            fn = _function(device.index if device.index is not None else torch.cuda.current_device())[1]
        k = _check(driver.cuGraphNodeGetDependencies(node, 0))[-1]
        deps = _check(driver.cuGraphNodeGetDependencies(node, k))[0] if k else []
        k = _check(driver.cuGraphNodeGetDependentNodes(node, 0))[-1]
        outs = _check(driver.cuGraphNodeGetDependentNodes(node, k))[0] if k else []
        # the kernel joins beside the memset first: a graph left part-edited by a refusal stays correct
        new = _check(driver.cuGraphAddKernelNode(g, deps, len(deps), _kernel_params(fn, fill)))
        if outs:
            _check(driver.cuGraphAddDependencies(g, [new] * len(outs), outs, None, len(outs)))
        _check(driver.cuGraphDestroyNode(node))  # and its edges
        done += 1
    return done


def unavailable(built: Built) -> str | None:
    """Why the rewrite cannot run in this build, or None."""
    if "step-graph" not in built.fast:
        return "it edits the step graph, which is off"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings) is not installed"
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):  # torch < 2.7
        return "this torch cannot hand out a captured graph before instantiating it"
    return None


def apply(built: Built) -> None:
    built.runner.rewrite_memsets = True  # type: ignore[attr-defined]  # a step_graph.GraphedSteps
