"""`--fused-ce`: liger-kernel's fused linear + cross-entropy for the LM head (CUDA). It computes the loss chunk
by chunk and never holds the [tokens, vocab] logits: far less memory, but a host sync a step. A setting of its
own, not a `--fast` path: it trades speed for memory.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lmpipe.consumer.fast import mix
from lmpipe.consumer.model import GPT, IGNORE

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

log = logging.getLogger("lmpipe.trainer")


@torch.compiler.disable
def _fused_ce(loss_fn, weight: torch.Tensor, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # liger's kernels are Triton already; traced by dynamo they broke the graph at every .item() (dozens
    # of graphs) and one inductor-compiled piece hit an illegal memory access on an H200. Run them as-is.
    return loss_fn(weight, h, targets)


def fused_linear_cross_entropy():
    """liger-kernel's fused linear + cross-entropy (summed over targets != IGNORE), or None when it is
    not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")


def head_inputs(model: GPT, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(h [N, C], w, targets [N]) for a fused head: autocast does not reach into one, and LayerNorm left h
    in fp32, so both take the matmuls' dtype."""
    w = model.lm_head.weight
    if torch.is_autocast_enabled(h.device.type):
        dt = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dt), w.to(dt)
    return h.reshape(-1, h.size(-1)), w, targets.reshape(-1)


class LigerLoss(GPT):
    fused_ce = None  # the liger loss module, set by use()

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, w, t = head_inputs(self, h, targets)
        return _fused_ce(self.fused_ce, w, h, t)


def use(model: GPT) -> bool:
    """The model's head loss as liger's; False where liger is not installed."""
    fn = fused_linear_cross_entropy()
    if fn is None:
        return False
    mix(model, LigerLoss)
    model.fused_ce = fn
    return True


def apply_setting(built: Built) -> None:
    """--fused-ce as the build has it: liger's loss on CUDA, where installed; said where it is not."""
    if built.device.type != "cuda":
        log.info("--fused-ce runs on CUDA only; on %s the loss is torch's", built.device.type)
    elif not use(built.model):
        log.warning("--fused-ce: liger-kernel is not installed (pip install 'lmpipe[fused]'); plain loss")
