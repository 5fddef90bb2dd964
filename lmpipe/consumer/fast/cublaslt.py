"""cuBLASLt GEMMs through nvmath-python (NVIDIA's binding), each shape's algorithm picked by timing.

torch asks cuBLASLt's heuristic for one algorithm per GEMM and exposes no epilogues. For most of a GPT-2
step that pick is as fast as any, but not for the LM head's GEMMs (consumer/fast/head_gemm.py); the MLP's
epilogues need nvmath (consumer/fast/mlp_kernel.py). nvmath plans a GEMM once per shape and can time
cuBLASLt's candidates (autotune); the plans are kept here, the library's used by the paths that need it.

Each call after the first goes straight to cuBLASLt's matmul through nvmath's binding, with the plan's
descriptors and best algorithm, a workspace from torch's allocator and the outputs made by torch. That is
what lets the training step be captured as a CUDA graph (consumer/fast/step_graph.py): `Matmul.execute()`
creates and records a CUDA event of its own and keeps its own workspace; the direct call also costs a third
of its host time (bench/results/host-h100-2026-11-27.md). The plan's descriptors are nvmath's attributes, not its API: with a
version without them every call takes `execute()`, and the step is not captured (step_graph._gemm_problem).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

# nvmath logs every plan at INFO to the root logger unless given one of its own
_nvmath_log = logging.getLogger(__name__ + ".nvmath")
_nvmath_log.setLevel(logging.WARNING)

# plans past this many (bucketed batches' shapes) take the heuristic's pick: timing one costs up to ~0.3 s
AUTOTUNED_SHAPES = 16

_plans: dict[tuple, Any] = {}  # nvmath Matmul objects
_workspaces: dict[torch.device, torch.Tensor] = {}  # one a device: every call is ordered on its stream
DIRECT = True  # False: every call through Matmul.execute() (bench.host compares the two)

# the planned Matmul's attributes the direct call reads (nvmath-python 1.0)
_DIRECT_NEEDS = ("handle", "mm_desc", "mm_desc_ifc", "alpha", "beta", "a_layout_ptr", "b_layout_ptr",
                 "c_layout_ptr", "d_layout_ptr", "cached_best_algorithm_struct", "workspace", "result_traits",
                 "d_dtype_name", "epilog_output_handlers", "epilog_input_name_to_handler", "num_operands")  # fmt: skip


@functools.cache
def nvmath_missing() -> str | None:
    """Why nvmath-python cannot run GEMMs here, or None."""
    try:
        import nvmath.linalg.advanced  # noqa: F401
    except ImportError:
        return "nvmath-python is not installed (pip install 'lmpipe[epilogue]')"
    except Exception as e:  # a broken CUDA library install: say it, train without
        return f"nvmath-python does not load ({type(e).__name__}: {e})"
    return None


def gemm(a: torch.Tensor, b: torch.Tensor, epilog=None, aux: torch.Tensor | None = None):
    """a @ b (CUDA tensors, any strides cuBLASLt takes) with `epilog` (an nvmath MatmulEpilog or None) and
    its auxiliary input; the result, or (result, auxiliary outputs) for an epilogue that makes them. Unlike
    torch's, the result takes a's layout where the epilogue asks for none (nvmath's rule): a column-major `a`
    gives a column-major result."""
    from nvmath.linalg.advanced import Matmul

    stream = torch.cuda.current_stream(a.device)
    inputs = None if aux is None else {"gelu_aux": aux}
    key = (epilog, a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device)
    mm = _plans.get(key)
    if mm is None:
        mm = Matmul(a, b, options={"blocking": "auto", "logger": _nvmath_log}, stream=stream)
        mm.plan(epilog=epilog, epilog_inputs=inputs, stream=stream)
        if len(_plans) < AUTOTUNED_SHAPES:
            mm.autotune(iterations=5, stream=stream)
        _plans[key] = mm
    elif DIRECT and _direct_ok(mm):
        return _direct(mm, a, b, inputs, stream)
    else:
        mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs, stream=stream)
    out = mm.execute(stream=stream)
    mm.release_operands()  # keep no activation alive between calls
    return out


def _direct_ok(mm) -> bool:
    """Whether this planned Matmul has what the direct call reads (a plain 2-operand GEMM)."""
    return all(hasattr(mm, name) for name in _DIRECT_NEEDS) and mm.num_operands == 2


def _workspace(device: torch.device, size: int) -> torch.Tensor:
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < size:
        # a bigger one replaces it; the old one's memory is reused only after the calls queued on it
        ws = _workspaces[device] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    return ws


def _direct(mm, a: torch.Tensor, b: torch.Tensor, inputs: dict[str, torch.Tensor] | None, stream):
    """mm's GEMM on a and b (the shapes and strides it was planned for), as execute() runs it."""
    from nvmath.bindings import cublasLt

    traits = mm.result_traits
    out = torch.empty_strided(traits.result_shape, traits.result_strides, dtype=getattr(torch, mm.d_dtype_name),
                              device=a.device)  # fmt: skip
    made = {}
    for handler in mm.epilog_output_handlers:
        shape, strides, dtype_name = handler.attributes()
        made[handler.name] = t = torch.empty_strided(
            shape, strides, dtype=getattr(torch, dtype_name), device=a.device
        )
        handler.update_pointer(mm.mm_desc_ifc, t.data_ptr())
    for name, t in (inputs or {}).items():
        mm.epilog_input_name_to_handler[name].update_pointer(mm.mm_desc_ifc, t.data_ptr())
    ws = _workspace(a.device, mm.workspace.size)
    cublasLt.matmul(
        mm.handle, mm.mm_desc, mm.alpha.ctypes.data,
        a.data_ptr(), mm.a_layout_ptr, b.data_ptr(), mm.b_layout_ptr,
        mm.beta.ctypes.data, 0, mm.c_layout_ptr, out.data_ptr(), mm.d_layout_ptr,
        mm.cached_best_algorithm_struct.ctypes.data, ws.data_ptr(), mm.workspace.size, stream.cuda_stream,
    )  # fmt: skip
    return (out, made) if mm.epilog_output_handlers else out
