"""What build() hands the trainer and the fast paths: the model, its optimizer and scaler, what the step calls,
and the settings they were built for. A module of its own so that the fast paths (consumer/fast/), which
take it, and build(), which applies them, import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.model import GPT
    from lmpipe.consumer.scaler import LossScaler
    from lmpipe.consumer.step import StepRunner


@dataclass
class Built:
    model: GPT  # the bare model: its parameters, state dict and FLOPs
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None  # fp16 only
    step_model: torch.nn.Module  # what the step calls: the model under DDP and/or compile
    runner: StepRunner
    tcfg: TrainConfig
    device: torch.device
    precision: str  # resolved: fp32, bf16, fp16 or fp8
    autocast_dtype: torch.dtype | None
    fast: list[str] = field(default_factory=list)  # the fast paths applied, in order (consumer/fast/)
    fast_line: str = ""  # what ran and why the rest did not, one line; the trainer logs it once resumed
