"""Path clip-in-step: the gradient clip inside the fused AdamW's step, not a pass of its own.

A fused optimizer divides each gradient by `grad_scale` as it reads it (GradScaler's protocol), so clipping
needs no pass of its own over the gradients: 0.2 ms of a GPT-2 124M step on an H100, net of the kernel writing
the gradients back (bench/results/levers-h100-2026-11-27.md). The runner sets grad_scale from the norm it
has computed (step.StepRunner.clip_and_update).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built


def unavailable(built: Built) -> str | None:
    if built.tcfg.grad_clip <= 0:
        return "--grad-clip 0: nothing to clip"
    if built.scaler is not None:
        return "fp16's loss scaler unscales the gradients first"
    if not getattr(built.optimizer, "_step_supports_amp_scaling", False):
        return "the optimizer (foreach AdamW) cannot scale gradients as it reads them"
    return None


def apply(built: Built) -> None:
    built.runner.clip_in_step = True
