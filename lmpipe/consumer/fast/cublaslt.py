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
# Autotuned picks, kept across restarts in the compile cache (consumer/compile_cache.py, keyed by GPU, CUDA,
# nvmath and lmpipe versions): per GEMM (pick_key), the rank of the fastest algorithm among the heuristic's
# candidates and what identifies it. A restart plans the same GEMM, finds the same algorithm at that rank and
# takes it without timing the candidates again; where the candidates differ (another pointer alignment, a
# library update) it times them as before.
_picks: dict[str, dict[str, Any]] = {}  # this process's picks (timed or reused): what the cache saves
_known: dict[str, dict[str, Any]] = {}  # picks read from the cache
_IDENTITY = ("algorithm_id", "tile", "stages", "split_k", "reduction_scheme", "cta_swizzling", "custom_option",
             "inner_shape", "cluster_shape")  # fmt: skip
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
        candidates = mm.plan(epilog=epilog, epilog_inputs=inputs, stream=stream)
        if len(_plans) < AUTOTUNED_SHAPES:
            _tune(mm, candidates, pick_key(epilog, a, b), epilog, inputs, stream)
        _plans[key] = mm
    elif DIRECT and _direct_ok(mm):
        return _direct(mm, a, b, inputs, stream)
    else:
        mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs, stream=stream)
    out = mm.execute(stream=stream)
    mm.release_operands()  # keep no activation alive between calls
    return out


def pick_key(epilog, a: torch.Tensor, b: torch.Tensor) -> str:
    """A GEMM as the cache names it: epilogue, shapes, strides and dtypes (the card is in the cache's key)."""
    name = getattr(epilog, "name", str(epilog))
    return f"{name}|{list(a.shape)}:{list(a.stride())}|{list(b.shape)}:{list(b.stride())}|{a.dtype}|{b.dtype}"


def identity(algorithm) -> dict[str, Any]:
    """What tells one cuBLASLt algorithm from another: its id and configuration, as JSON values."""
    out: dict[str, Any] = {}
    for name in _IDENTITY:
        try:
            v = getattr(algorithm, name)
        except Exception:  # an attribute this algorithm (or nvmath version) does not have
            continue
        out[name] = [int(x) for x in v] if isinstance(v, (tuple, list)) else int(v) if _is_int(v) else str(v)
    return out


def _is_int(v) -> bool:
    try:
        return int(v) == v
    except (TypeError, ValueError):
        return False


def pick_rank(candidates, known: dict[str, Any] | None) -> int | None:
    """The rank among `candidates` (the heuristic's, in its order) of the algorithm `known` records, if that
    rank holds the same algorithm; None: time them (no pick, or the candidates changed)."""
    if not known or not isinstance(known.get("rank"), int) or not isinstance(known.get("algorithm"), dict):
        return None
    rank = known["rank"]
    if not 0 <= rank < len(candidates) or identity(candidates[rank]) != known["algorithm"]:
        return None
    return rank


def picks() -> dict[str, dict[str, Any]]:
    """The picks of this process (timed or reused), for the compile cache."""
    return dict(_picks)


def load_picks(saved: dict[str, Any]) -> None:
    """Picks read back from the compile cache; an entry of another form is ignored (timed again)."""
    _known.update({k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, dict)})


def _tune(mm, candidates, key: str, epilog, inputs, stream) -> None:
    """Take the cached pick for this GEMM if its candidates hold it, else time them (nvmath's autotune); record
    the pick either way. A cached pick that nvmath refuses is timed again: the cache never fails a GEMM."""
    candidates = list(candidates or [])
    rank = pick_rank(candidates, _known.get(key))
    if rank is not None:
        try:
            mm.plan(epilog=epilog, epilog_inputs=inputs, algorithms=[candidates[rank]], stream=stream)
            _picks[key] = _known[key]
            return
        except Exception:
            mm.plan(epilog=epilog, epilog_inputs=inputs, stream=stream)
    mm.autotune(iterations=5, stream=stream)
    try:
        best = mm.algorithms[0]
        rank = next(i for i, c in enumerate(candidates) if identity(c) == identity(best))
        _picks[key] = {"rank": rank, "algorithm": identity(best)}
    except Exception:  # nothing to record: the next start times this GEMM again
        pass


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
