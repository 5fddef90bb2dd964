"""Path adamw: AdamW's update as one Triton kernel a parameter group, over a table of the tensors' addresses
(CUDA, fp32).

AdamW's work is memory traffic only: read the weights, gradients and both moments, write the weights and
moments, and torch's fused AdamW does it well below the memory's speed on GPT-2 124M's 75 tensors. Here each
program of one launch takes one chunk of one tensor from a table whose rows hold the chunk's four addresses,
its step counter's address and its length, so every tensor, small or large, is one grid. The table is
rebuilt (and uploaded without a host sync) only when a tensor moves; the caching allocator hands the
gradients the same blocks every step. 1.006-1.018x tokens/s pipeline-fed, GPT-2 124M at 32 rows on an H100
(bench/results/adamw-h100-2026-11-27.md).

The optimizer is torch.optim.AdamW (fused) with this step: the same state ('step', 'exp_avg', 'exp_avg_sq'),
so checkpoints move between the two, and torch's fused kernel still runs whatever this one does not take:
amsgrad, maximize, non-fp32 or non-contiguous tensors, and a loss scaler's found_inf (fp16). A tensor lr
(0-d fp32 on the parameters' device) is read by the kernel, so a captured CUDA graph's step follows it.
bench.optimizer times the two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

CHUNK = 16384  # elements a program updates, one table row (bench.optimizer: 16k-256k x 1k-4k x 4-16 warps)
BLOCK = 4096  # elements a program holds at a time
WARPS = 8


@triton.jit
def _adamw(table, lr, beta1, beta2, eps, decay, scale, HAS_SCALE: tl.constexpr, LR_PTR: tl.constexpr,
           CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """torch's AdamW for one chunk: w -= lr * decay * w; m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2)
    g^2; w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps), with g the gradient divided by
    scale[0] where HAS_SCALE (a clip's factor), t the tensor's step counter (already advanced); lr is read
    from memory where LR_PTR."""
    if LR_PTR:
        lr = tl.load(lr)
    row = table + tl.program_id(0).to(tl.int64) * 6
    w = tl.load(row).to(tl.pointer_type(tl.float32))
    g = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    t = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
    n = tl.load(row + 5)
    step_size = lr / (1.0 - tl.exp(t * tl.log(beta1)))
    root_bc2 = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2)))
    inv = 1.0 / tl.load(scale) if HAS_SCALE else 1.0
    for off in range(0, CHUNK, BLOCK):
        i = off + tl.arange(0, BLOCK)
        k = i < n
        gi = tl.load(g + i, mask=k, other=0.0) * inv
        wi = tl.load(w + i, mask=k, other=0.0) * (1.0 - lr * decay)
        mi = tl.load(m + i, mask=k, other=0.0)
        mi = mi + (1.0 - beta1) * (gi - mi)
        vi = tl.load(v + i, mask=k, other=0.0) * beta2 + (1.0 - beta2) * gi * gi
        wi = wi - step_size * mi / (tl.sqrt(vi) / root_bc2 + eps)
        tl.store(w + i, wi, mask=k)
        tl.store(m + i, mi, mask=k)
        tl.store(v + i, vi, mask=k)


def _table(ws, gs, ms, vs, steps, device: torch.device) -> torch.Tensor:
    """One row per CHUNK elements of each tensor: its four addresses at the chunk, the step's, the length."""
    sizes = np.array([w.numel() for w in ws], dtype=np.int64)
    chunks = -(-sizes // CHUNK)
    tensor = np.repeat(np.arange(len(ws)), chunks)
    off = (np.arange(len(tensor)) - np.repeat(np.cumsum(chunks) - chunks, chunks)) * CHUNK
    addr = [np.array([x.data_ptr() for x in xs], dtype=np.int64)[tensor] + 4 * off for xs in (ws, gs, ms, vs)]
    step = np.array([s.data_ptr() for s in steps], dtype=np.int64)[tensor]
    rows = torch.from_numpy(np.stack([*addr, step, np.minimum(CHUNK, sizes[tensor] - off)], axis=1))
    if device.type == "cuda":  # a pinned copy goes without a host sync; the allocator keeps it until copied
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


def _dense_fp32(g: torch.Tensor | None) -> bool:
    return g is not None and g.dtype == torch.float32 and g.is_contiguous() and not g.is_sparse


def _device_scalar(lr: torch.Tensor, params: list[torch.Tensor]) -> bool:
    return lr.dim() == 0 and lr.dtype == torch.float32 and all(p.device == lr.device for p in params)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) whose step runs the Triton kernel above where it can."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, fused=True, **kwargs)
        self._tables: dict[int, tuple[tuple, torch.Tensor]] = {}

    def _takes(self, group: dict, params: list[torch.Tensor]) -> bool:
        return (
            getattr(self, "found_inf", None) is None
            and not (group["amsgrad"] or group["maximize"])
            and (not torch.is_tensor(group["lr"]) or _device_scalar(group["lr"], params))
            and all(p.dtype == torch.float32 and p.is_contiguous() and _dense_fp32(p.grad) for p in params)
        )

    @torch.no_grad()
    def step(self, closure=None):
        params_of = [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]
        if closure is not None or not all(self._takes(g, ps) for g, ps in zip(self.param_groups, params_of)):
            return super().step(closure)
        scale = getattr(self, "grad_scale", None)
        for i, (group, ws) in enumerate(zip(self.param_groups, params_of)):
            if not ws:
                continue
            for w in ws:
                state = self.state[w]
                if not state:  # as torch's fused AdamW starts it: a device step counter, zero moments
                    state["step"] = torch.zeros((), dtype=torch.float32, device=w.device)
                    state["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            states = [self.state[w] for w in ws]
            gs = [w.grad for w in ws]
            ms, vs, steps = ([s[k] for s in states] for k in ("exp_avg", "exp_avg_sq", "step"))
            key = tuple(x.data_ptr() for xs in (ws, gs, ms, vs, steps) for x in xs)
            cached = self._tables.get(i)
            if cached is None or cached[0] != key:
                cached = self._tables[i] = (key, _table(ws, gs, ms, vs, steps, ws[0].device))
            table = cached[1]
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            _adamw[(table.size(0),)](
                table, lr if torch.is_tensor(lr) else float(lr), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), scale if scale is not None else table, HAS_SCALE=scale is not None,
                LR_PTR=torch.is_tensor(lr), CHUNK=CHUNK, BLOCK=BLOCK, num_warps=WARPS,
            )  # fmt: skip
        return None


def unavailable(built: Built) -> str | None:
    if not built.tcfg.fused_adamw:
        return "--no-fused-adamw asks for torch's foreach AdamW"
    return None


def apply(built: Built) -> None:
    """torch's AdamW of the plain build, replaced by this one over the same groups and hyperparameters."""
    cfg, old = built.tcfg, built.optimizer
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in old.param_groups]
    built.optimizer = built.runner.optimizer = AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8
    )
