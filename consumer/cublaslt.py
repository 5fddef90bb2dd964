"""cuBLASLt GEMMs through nvmath-python (NVIDIA's binding), each shape's algorithm picked by timing.

torch asks cuBLASLt's heuristic for one algorithm per GEMM. For most of a GPT-2 step that pick is as fast
as any, but not for the LM head's forward (h W^T over the 50k vocabulary: 3.83 ms against 3.33 ms for the
best algorithm timed, an H100) and weight gradient (3.37 against 3.28 ms), nor for the MLP's GELU epilogue
GEMM (7% slower), and torch exposes no epilogues at all (bench/results/head-h100-2026-11-27.md,
gelu-epilogue-h100-2026-11-27.md). nvmath plans a GEMM once per shape and can time cuBLASLt's candidates
(autotune); the plans are kept here.
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


@functools.cache
def unavailable() -> str | None:
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
    its auxiliary input; the result, or (result, auxiliary outputs) for an epilogue that makes them."""
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
    else:
        mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs, stream=stream)
    out = mm.execute(stream=stream)
    mm.release_operands()  # keep no activation alive between calls
    return out
