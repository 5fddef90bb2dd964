"""One optimizer step, the reference path (`--fast none`): the LR schedule, AdamW, and forward/backward over
a step's micro-batches.

Loss normalisation: the loss of a step is the sum of per-token losses over all its micro-batches divided by
the number of target tokens in all of them. That count is known on the host from the batch headers before
any backward pass, so N micro-batches with accumulation N give exactly the update of one N-times batch,
whatever the padding in each.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable

import torch

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.inputs import ModelInputs
from lmpipe.consumer.scaler import LossScaler

log = logging.getLogger("lmpipe.trainer")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr over lr_decay_steps (or `steps`)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    horizon = cfg.lr_decay_steps or cfg.steps
    if horizon <= cfg.warmup:
        return cfg.lr
    t = min(1.0, (step - cfg.warmup) / (horizon - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW, decaying only matrices (nanoGPT's split), fused where asked and supported, else foreach."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.fused_adamw:
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=1e-8, fused=True)
        except (RuntimeError, TypeError) as exc:  # e.g. a device torch has no fused AdamW for
            log.warning("fused AdamW unavailable (%s); using the foreach implementation", exc)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=1e-8, foreach=True)


class StepRunner:
    """Forward/backward over a step's micro-batches and one optimizer step. Returns device tensors only."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        autocast_dtype,
        scaler: LossScaler | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        strategy: str = "pack",
    ):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.strategy = strategy  # the batches' (shared/config.py): pack and pad keep one shape
        self.no_sync = no_sync  # DDP: skip the gradient all-reduce on all but a step's last micro-batch
        self.device_type = next(model.parameters()).device.type
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler
        # CUDA graphs (compile mode reduce-overhead/max-autotune): each forward starts a new replay, so
        # the previous step's outputs (already read) may be overwritten
        self.cudagraphs = cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")
        self.graphs = False  # whether a step may be captured as CUDA graphs (consumer/fast/step_graph.py)
        # under torchrun: whether a flag holds on every rank (a capture is collective), and DDP's stream
        self.all_ranks: Callable[[bool], bool] | None = None
        self.capture_stream: torch.cuda.Stream | None = None
        self.clip_in_step = False  # clip inside the optimizer's step (consumer/fast/clip.py)
        self.autocast_cache = True  # autocast's cache of cast weights in eager steps

    def _autocast(self, cache: bool = True):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=cache)

    def step(self, micro: list[ModelInputs], denom: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `micro`, the summed loss divided by `denom` (the step's target tokens;
        under DDP, which averages gradients over R ranks, all ranks' targets / R). Returns (summed loss
        over this rank's targets, grad norm before clipping)."""
        denom = denom if denom > 0 else 1.0
        self.model.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=micro[0].idx.device)
        for i, inp in enumerate(micro):
            last = i == len(micro) - 1
            with self.no_sync() if (self.no_sync and not last) else contextlib.nullcontext():
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                loss_sum += self.forward_backward(inp, denom, cache=self.autocast_cache)
        norm = self.clip_and_update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm

    def forward_backward(
        self, inp: ModelInputs, denom: float | torch.Tensor, cache: bool = True
    ) -> torch.Tensor:
        """One micro-batch's forward and backward of loss / denom; its summed loss, detached. `cache`: autocast's
        cache of cast weights (off for a CUDA graph's capture, as torch's CUDA-graph notes ask)."""
        with self._autocast(cache):
            _, loss = self.model(inp.idx, inp.pos, inp.attn, inp.targets)
        scaled = loss / denom
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach()

    def clip_and_update(self) -> torch.Tensor:
        """The grad norm (returned, before clipping), the clip and the optimizer's step; the gradients stay."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        # a fused optimizer divides each gradient by `grad_scale` as it reads it (GradScaler's protocol)
        in_step = (
            self.clip_in_step
            and self.cfg.grad_clip > 0
            and not self.scaler
            and getattr(self.optimizer, "_step_supports_amp_scaling", False)
        )
        if self.cfg.grad_clip > 0 and not in_step:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.grad_clip, norm)
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped on the device when gradients overflowed
            self.scaler.update()
        elif in_step:
            # clip_grad_norm_ multiplies by grad_clip / (norm + 1e-6), at most 1
            self.optimizer.grad_scale = ((norm + 1e-6) / self.cfg.grad_clip).clamp(min=1.0)  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale  # type: ignore[attr-defined]
        else:
            self.optimizer.step()
        return norm


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`local_rank` (under torchrun) picks the GPU of a bare `cuda` or `auto`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None and local_rank is not None:
        dev = torch.device("cuda", local_rank)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return dev


def resolve_precision(name: str, device: torch.device):
    """(precision, autocast dtype). fp8 runs under bf16 autocast: only its converted matmuls are fp8."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "fp8" and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(
            "--precision fp8 needs a GPU with FP8 matmuls (compute capability 8.9+: H100, H200, L4)"
        )
    return name, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[name]


def to_float8(model: torch.nn.Module) -> int:
    """Swap the transformer blocks' Linear layers for torchao's float8 training layers (dynamic tensorwise
    scaling) where float8 pays; returns how many were swapped. torchao's filter keeps layers too small to
    gain in bf16 (on an H100 the casts and scales cost more than the FP8 matmul saves below about
    4096 x 1024), and those whose sizes are not multiples of 16. lm_head stays bf16: it shares its weight
    with the embedding, and the logits are where fp8's 3-bit mantissa would cost the most accuracy."""
    try:
        from torchao.float8 import _auto_filter_for_recipe, convert_to_float8_training
    except ImportError:
        raise ValueError("--precision fp8 needs torchao: pip install 'lmpipe[fp8]'") from None

    wanted = _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])
    n = sum(1 for fqn, m in model.named_modules() if wanted(m, fqn))
    convert_to_float8_training(model, module_filter_fn=wanted)
    return n
