"""Loss scalers for fp16 training, with torch.amp.GradScaler's interface and no host sync per step.

Both are built on torch's fused primitives: `_amp_foreach_non_finite_check_and_unscale_` unscales every
gradient and sets `found_inf` in one pass per (device, dtype) group; `_amp_update_scale_` grows or backs
off the scale on the device. With a fused optimizer (fused AdamW), `found_inf` is handed to its kernel,
which skips the update where it is set, so a skipped step needs no `.item()`. Overflow and skipped-step
counts accumulate in device tensors and are read at the logging interval.

GradScaler itself would do, but it reads `found_inf` on the host for non-fused optimizers, exposes no
overflow counters, and has no static mode; these ~100 lines are the difference.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


class LossScaler:
    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        device: str | torch.device = "cuda",
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        dev = torch.device(device)
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=dev)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._overflows = torch.zeros((), dtype=torch.float32, device=dev)
        self._skipped = torch.zeros((), dtype=torch.float32, device=dev)
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self._stage = READY

    # -- GradScaler interface ------------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self._scale.to(outputs.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stage is not READY:
            raise RuntimeError(f"unscale_() called twice before update() (stage {self._stage})")
        inv_scale = self._scale.double().reciprocal().float()
        self._found_inf.zero_()
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    groups[(p.grad.device, p.grad.dtype)].append(p.grad)
        for grads in groups.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv_scale)
        self._stage = UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._stage is READY:
            self.unscale_(optimizer)
        elif self._stage is STEPPED:
            raise RuntimeError("step() called twice before update()")
        self._overflows += self._found_inf
        self._skipped += self._found_inf
        if getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: the kernel skips on found_inf
            # torch's fused optimizers read these two attributes (GradScaler's protocol); Optimizer does
            # not declare them, hence the ignores
            optimizer.grad_scale = None  # type: ignore[attr-defined]  # gradients are already unscaled
            optimizer.found_inf = self._found_inf  # type: ignore[attr-defined]
            try:
                out = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif self._found_inf.item() == 0:  # a non-fused optimizer has to be told on the host
            out = optimizer.step(*args, **kwargs)
        else:
            out = None
        self._stage = STEPPED
        return out

    def update(self, new_scale: float | None = None) -> None:
        if new_scale is not None:
            self._scale.fill_(new_scale)
        elif self.dynamic:
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                self._found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
        self._stage = READY

    def device_values(self) -> list[torch.Tensor]:
        """The scale, the overflows and the skipped steps so far, on the device (float32 scalars): what a
        logging interval reports, copied to the host without a sync (consumer/runstats.py)."""
        return [self._scale, self._overflows, self._skipped]

    def get_scale(self) -> float:
        return float(self._scale)  # a host sync: call it at logging intervals only

    def counters(self) -> tuple[float, float]:
        """(overflows, skipped steps) so far; a host sync."""
        return float(self._overflows), float(self._skipped)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.detach().cpu(),
            "growth_tracker": self._growth_tracker.detach().cpu(),
            "overflows": self._overflows.detach().cpu(),
            "skipped": self._skipped.detach().cpu(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state["dynamic"]) != self.dynamic:
            raise ValueError(f"checkpoint has a {'dynamic' if state['dynamic'] else 'static'} loss scaler")
        for name in ("scale", "growth_tracker", "overflows", "skipped"):
            getattr(self, f"_{name}").copy_(state[name])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]


class DynamicLossScaler(LossScaler):
    """Halves the scale on overflow (and skips that step), doubles it after growth_interval clean steps."""

    dynamic = True


class StaticLossScaler(LossScaler):
    """A fixed scale; steps whose gradients overflow are skipped, the scale never changes."""

    dynamic = False

    def __init__(self, scale: float, device: str | torch.device = "cuda"):
        super().__init__(init_scale=scale, device=device)


def make_scaler(spec: str, device: torch.device) -> LossScaler | None:
    """`dynamic`, `static:VALUE`, or `none` (fp16 with no scaling, for comparison)."""
    if spec == "none":
        return None
    if spec == "dynamic":
        return DynamicLossScaler(device=device)
    if spec.startswith("static:"):
        try:
            value = float(spec.split(":", 1)[1])
        except ValueError:
            value = 0.0
        if value > 0:
            return StaticLossScaler(value, device=device)
    raise ValueError(f"--loss-scale must be dynamic, static:VALUE (VALUE > 0) or none, not {spec!r}")
