"""Path head-gemm: the loss kernel's LM-head GEMMs (consumer/fast/loss.py), forward and weight gradient,
through cublaslt.gemm with cuBLASLt's fastest algorithm timed, in bf16: the forward's 3.33 ms against torch's
3.83 ms for GPT-2 124M at 32 rows on an H100 (bench/results/head-h100-2026-11-27.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmpipe.consumer.fast import cublaslt, mix
from lmpipe.consumer.fast.loss import KernelLoss

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built


class TunedHead(KernelLoss):
    tuned_head_gemm = True


def unavailable(built: Built) -> str | None:
    if "loss-kernel" not in built.fast:
        return "these are loss-kernel's GEMMs, and it is off"
    if built.autocast_dtype is not torch.bfloat16:
        return f"its plans are for bf16 GEMMs; this run's matmuls are {built.precision}"
    return cublaslt.nvmath_missing()


def apply(built: Built) -> None:
    mix(built.model, TunedHead)
