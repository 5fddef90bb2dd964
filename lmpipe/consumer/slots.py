"""Preallocated host slots that received batches are decoded into.

Each slot owns flat buffers sized for the largest batch (rows x seq_len), page-locked when CUDA is in use
so the copy engine can DMA from them asynchronously. A batch of shape [B, L] fills the first B*L elements
and is viewed as [B, L]: contiguous, so one DMA per array. A slot goes back to the receiver only once
the step loop's copy out of it has completed (see Trainer._release_done).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmpipe.shared.batch import Batch, Cursor


@dataclass
class SlotMeta:
    shard: int
    seq: int
    session: str
    cursor: Cursor
    strategy: str
    rows: int
    width: int
    real_tokens: int
    pad_tokens: int
    n_targets: int  # targets the loss is taken on (in the same document, loss mask 1)
    doc_id: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    received_at: float = 0.0
    # a mixture's assembled batch (consumer/mixer.py): where its runs of rows came from (the doc log's)
    parts: list | None = None
    row_index: Any = None  # the mixer's index of its rows (consumer/mixer.py's RowIndex), made once


class HostSlot:
    def __init__(self, rows: int, seq_len: int, token_dtype: np.dtype, pin: bool):
        tdt = torch.uint16 if token_dtype == np.dtype("<u2") else torch.int32
        n = rows * seq_len
        self.tokens = torch.empty(n, dtype=tdt, pin_memory=pin)
        self.seg = torch.empty(n, dtype=torch.uint16, pin_memory=pin)
        self.lengths = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self._np_tokens = self.tokens.numpy()
        self._np_seg = self.seg.numpy()
        self._np_lengths = self.lengths.numpy()
        self.loss_mask = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        self._np_loss_mask = self.loss_mask.numpy()
        self.has_seg = False
        self.has_loss_mask = False
        self.meta: SlotMeta | None = None

    def fill(self, batch: Batch, shard: int, seq: int, session: str, received_at: float) -> None:
        """Copy a validated batch out of the receive buffers (the ZeroMQ frames) into this slot."""
        B, L = batch.tokens.shape
        self._np_tokens[: B * L] = batch.tokens.reshape(-1)
        self._np_lengths[:B] = batch.lengths
        self.has_seg = batch.seg is not None
        if batch.seg is not None:
            self._np_seg[: B * L] = batch.seg.reshape(-1)
        self.has_loss_mask = batch.loss_mask is not None
        if batch.loss_mask is not None:
            self._np_loss_mask[: B * L] = batch.loss_mask.reshape(-1)
        self.meta = SlotMeta(
            shard=shard,
            seq=seq,
            session=session,
            cursor=batch.cursor,
            strategy=batch.strategy,
            rows=B,
            width=L,
            real_tokens=batch.real_tokens,
            pad_tokens=batch.pad_tokens,
            n_targets=batch.num_targets(),
            doc_id=batch.doc_id.copy(),
            doc_start=batch.doc_start.copy(),
            doc_len=batch.doc_len.copy(),
            received_at=received_at,
        )

    def views(self, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(tokens [B, L], lengths [B], seg [B, L] or None) over this slot's buffers.

        `rows` > B pads a short batch with empty rows (length 0: no targets, nothing attends to them), so
        a compiled model sees one batch dimension instead of recompiling for every short final batch."""
        m = self.meta
        assert m is not None
        B = max(rows or m.rows, m.rows)
        if m.rows < B:
            self._np_tokens[m.rows * m.width : B * m.width] = 0
            self._np_seg[m.rows * m.width : B * m.width] = 0
            self._np_lengths[m.rows : B] = 0
        n = B * m.width
        tokens = self.tokens[:n].view(B, m.width)
        seg = self.seg[:n].view(B, m.width) if self.has_seg else None
        return tokens, self.lengths[:B], seg

    def loss_mask_view(self, rows: int | None = None) -> torch.Tensor | None:
        """loss_mask [B, L] over this slot's buffer (rows as in views(), padding rows 0), or None when
        the batch has none (every target is trained)."""
        m = self.meta
        assert m is not None
        if not self.has_loss_mask:
            return None
        B = max(rows or m.rows, m.rows)
        self._np_loss_mask[m.rows * m.width : B * m.width] = 0
        return self.loss_mask[: B * m.width].view(B, m.width)
