"""The loss on held-out data (`--eval-data`), every `--eval-every` steps and at the end of training.

The batches come ready from the launcher (lmpipe/evaldata.py: made by the producers' own code, the same
batches every time) as `shared.batch.Batch` arrays: this module only scores them. The bare model (no DDP,
no compile, no CUDA graph) runs them in eval mode, without gradients, under the training's autocast, and the
summed loss over their targets divided by the number of targets is the eval loss: the training loss's
definition, on other text. Under torchrun, rank 0 evaluates (the bare model's forward needs no other rank)
and speaks for the job; the other ranks go on to the next step's all-reduce and wait there for it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from lmpipe.consumer.inputs import MaskCache, ModelInputs, build_inputs
from lmpipe.consumer.report import format_loss
from lmpipe.shared.batch import Batch

log = logging.getLogger("lmpipe.trainer")


class Evaluator:
    def __init__(self, batches: list[Batch], every: int, model: torch.nn.Module, autocast: Any,
                 device: torch.device, attention: str, mask_cache: MaskCache, metrics: Any) -> None:  # fmt: skip
        """`autocast`: a callable giving the training step's autocast context (StepRunner._autocast)."""
        self.batches, self.every, self.model, self.autocast = batches, every, model, autocast
        self.device, self.attention, self.mask_cache, self.metrics = device, attention, mask_cache, metrics
        self.targets = sum(b.num_targets() for b in batches)
        self.last_step = -1
        self.sinks: Any = None  # --log-to (consumer/sinks.py), set by the trainer

    def _inputs(self, b: Batch) -> ModelInputs:
        def dev(a: np.ndarray | None, dtype: Any) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a.astype(dtype)).to(self.device)

        tokens, lengths = dev(b.tokens, np.int64), dev(b.lengths, np.int32)
        assert tokens is not None and lengths is not None
        return build_inputs(
            tokens, lengths, dev(b.seg, np.int32), attention=self.attention, mask_cache=self.mask_cache,
            loss_mask=dev(b.loss_mask, np.uint8), seg_host=b.seg.astype(np.int32) if b.seg is not None else None,
        )  # fmt: skip

    @torch.no_grad()
    def loss(self) -> float:
        """The mean loss per target over the held-out batches (NaN if they hold no target)."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        try:
            for b in self.batches:
                inp = self._inputs(b)
                with self.autocast():
                    _, loss_sum = self.model(inp.idx, inp.pos, inp.attn, inp.targets)
                total += loss_sum.double()
        finally:
            self.model.train(was_training)
        return float(total) / self.targets if self.targets else math.nan

    def maybe(self, step: int, summary: Any, *, end: bool = False, is_main: bool = True) -> None:
        """Evaluate at every --eval-every step and at the end (once per step); the log line, the metric
        and the summary (its last eval loss, and each evaluation's step and loss for `lmpipe plot`)."""
        if not is_main or step == self.last_step or not step or (not end and step % self.every):
            return
        t0 = time.perf_counter()
        value = self.loss()
        self.last_step = step
        self.metrics.eval_loss.set(value)
        summary.eval_loss = value
        summary.evals.append({"step": step, "eval_loss": value})
        if self.sinks:
            self.sinks.log(step, {"eval/loss": value})
        log.info("step %d | eval loss %s (%d held-out batches, %s targets, %.1f s)", step, format_loss(value),
                 len(self.batches), f"{self.targets:,}", time.perf_counter() - t0)  # fmt: skip
