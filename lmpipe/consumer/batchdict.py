"""The library's batch: a dict of tensors in the convention Hugging Face models and varlen kernels take.

input_ids     [B, L] int64   token ids (pads: 0)
labels        [B, L] int64   NOT shifted (the model shifts): labels[:, t] = input_ids[:, t] where that token
                             is a trained target, else -100: at pads, at each document's first token (no
                             earlier token of its document predicts it), and where the loss mask is 0
                             (prompts). Exactly the targets lmpipe's own trainer trains, shifted right by one.
position_ids  [B, L] int64   position inside the document: restarts at 0 at each document
document_ids  [B, L] int32   which document piece of its row a token belongs to (the wire's `seg`);
                             strategies without seg (pad, pad-batch, bucket): 0, one document per row
cu_seqlens    [n + 1] int32  offsets of the n document pieces in the flattened [B * L] batch, then B * L
                             (a new row starts a new piece; pads belong to their row's last piece)
max_seqlen    int            the longest piece
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmpipe.consumer.inputs import (
    document_block_mask,
    document_causal_mask_mod,
    piece_starts,
    positions,
    targets_for,
)
from lmpipe.consumer.model import IGNORE


def cu_seqlens_exact(seg_host: np.ndarray) -> np.ndarray:
    """inputs.piece_starts, then B * L (int32, unpadded)."""
    return np.append(piece_starts(seg_host), seg_host.size).astype(np.int32)


def labels_from_targets(targets: torch.Tensor) -> torch.Tensor:
    """lmpipe's targets (targets[:, t] predicts from position t) as Hugging Face labels (labels[:, t] is
    predicted from position t - 1): shifted right by one, -100 in column 0."""
    labels = torch.full_like(targets, IGNORE)
    labels[:, 1:] = targets[:, :-1]
    return labels


def batch_dict(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    seg: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> dict[str, Any]:
    """The batch dict (this module's docstring) from a batch's arrays on the device."""
    B, L = tokens.shape
    ids = tokens.long()
    targets = targets_for(ids, lengths, seg, loss_mask)
    if seg is None:
        doc = torch.zeros(B, L, dtype=torch.int32, device=ids.device)
        pos = torch.arange(L, device=ids.device).expand(B, L).contiguous()
    else:
        doc = seg.to(torch.int32)
        pos = positions(doc)
    return {
        "input_ids": ids,
        "labels": labels_from_targets(targets),
        "position_ids": pos,
        "document_ids": doc,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max_seqlen,
    }


def dense_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The document-causal attention mask [B, 1, L, L] (bool, True: may attend) of a batch dict: what SDPA's
    attn_mask or an eager attention takes."""
    doc = batch["document_ids"]
    L = doc.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def block_mask(batch: dict[str, Any], block: int = 128):
    """FlexAttention's document-causal BlockMask of a batch dict (what `flex_attention(..., block_mask=)`
    takes), built without evaluating the mask at every position where L is a multiple of `block`."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = batch["document_ids"]
    B, L = doc.shape
    if L % block == 0:
        return document_block_mask(doc, block)
    return create_block_mask(document_causal_mask_mod(doc), B, None, L, L, device=doc.device)
