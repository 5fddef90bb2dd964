"""From a batch's arrays on the device to what the model takes: ids, positions, targets, attention mask.

Targets are the next token in the same row *and the same document*; pads and the token after a
document's end are IGNORE, so the loss never trains on padding or across documents. Where the batch has a
loss mask, a target is also IGNORE when the mask of the token it predicts is 0 (a prompt): those positions
add nothing to the summed loss and get exactly zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from lmpipe.consumer.model import IGNORE, AttnSpec
from lmpipe.shared.config import PipelineConfig

# cu_seqlens is padded to a bucket, at least this long: a compiled model sees few shapes
MIN_BUCKET = 64


def piece_starts(seg_host: np.ndarray) -> np.ndarray:
    """Where each document piece starts in the flattened [B * L] batch. A piece is a run of equal `seg`
    inside one row: a new row always starts a new piece, even where the same document carries on (attention
    never crosses rows)."""
    B, L = seg_host.shape
    new = np.ones((B, L), dtype=bool)
    new[:, 1:] = seg_host[:, 1:] != seg_host[:, :-1]
    return np.flatnonzero(new.ravel())


def cu_seqlens_host(seg_host: np.ndarray) -> np.ndarray:
    """piece_starts, then B * L, padded to a bucket (the next power of two of the piece count, at least
    MIN_BUCKET) by repeating B * L: empty documents. This is `--attention flash`'s mask
    (consumer/fast/flash.py)."""
    B, L = seg_host.shape
    starts = piece_starts(seg_host)
    bucket = max(MIN_BUCKET, 1 << int(len(starts)).bit_length())  # > len(starts): room for the end
    cu = np.full(bucket, B * L, dtype=np.int32)
    cu[: len(starts)] = starts
    return cu


class MaskCache:
    """Causal masks by (length, device) for the exact eager path. Shapes repeat (pack, pad: one length;
    bucket: a bounded set), so building a fresh [L, L] mask per layer per step would be waste."""

    name = "causal_mask"

    def __init__(self, on_hit=None, on_miss=None):
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        self.hits = self.misses = 0
        self._on_hit, self._on_miss = on_hit, on_miss

    def causal(self, length: int, device: torch.device) -> torch.Tensor:
        key = (length, str(device))
        mask = self._masks.get(key)
        if mask is None:
            self.misses += 1
            if self._on_miss:
                self._on_miss()
            mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            self._masks[key] = mask
        else:
            self.hits += 1
            if self._on_hit:
                self._on_hit()
        return mask


@dataclass
class ModelInputs:
    idx: torch.Tensor  # [B, L] int64
    pos: torch.Tensor  # [B, L] int64
    targets: torch.Tensor  # [B, L] int64, IGNORE where no target
    attn: AttnSpec


def positions(seg: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document: restarts at 0 where seg changes."""
    B, L = seg.shape
    idx = torch.arange(L, device=seg.device).expand(B, L)
    starts = torch.zeros_like(idx)
    starts[:, 1:] = torch.where(seg[:, 1:] != seg[:, :-1], idx[:, 1:], 0)
    return idx - starts.cummax(dim=1).values


def targets_for(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    seg: torch.Tensor | None,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """targets[:, t] = tokens[:, t + 1] where that is a trained target, else IGNORE."""
    B, L = tokens.shape
    targets = torch.full_like(tokens, IGNORE)
    valid = torch.arange(L - 1, device=tokens.device)[None, :] < (lengths[:, None] - 1)
    if seg is not None:
        valid &= seg[:, 1:] == seg[:, :-1]
    if loss_mask is not None:
        valid &= loss_mask[:, 1:] != 0
    targets[:, :-1] = torch.where(valid, tokens[:, 1:], IGNORE)
    return targets


def document_causal_mask_mod(seg: torch.Tensor):
    """FlexAttention mask_mod: attend to earlier-or-same positions of the same document."""

    def mask_mod(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (q >= kv)

    return mask_mod


def document_block_mask(seg: torch.Tensor, block: int = 128) -> BlockMask:
    """The document-causal BlockMask of rows whose seg never decreases along a row (the receiver checks
    that), from each block's first and last document in a dozen tensor ops and no host sync.

    create_block_mask gets the same answer by evaluating the mask at every (q, kv) through vmap: 12 ms of
    host time per 32 x 256 batch on an H100, most of a small model's step (bench/results/overhead-*.md).
    A kv block before the q block is full when both hold one and the same document, empty when they share
    none, partial otherwise; the diagonal block is always partial (causal inside it)."""
    B, L = seg.shape
    nb = L // block
    s = seg.view(B, nb, block)
    lo, hi = s[..., 0], s[..., -1]  # [B, nb]: first and last document of each block
    i = torch.arange(nb, device=seg.device)
    before = (i[:, None] > i[None, :])[None]  # [1, q block, kv block]
    shares = hi[:, None, :] >= lo[:, :, None]  # a kv block before q's reaches q's first document
    one_doc = lo == hi
    full = before & (one_doc[:, :, None] & one_doc[:, None, :]) & (lo[:, None, :] == lo[:, :, None])
    partial = ((before & shares) | (i[:, None] == i[None, :])[None]) & ~full

    def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, 1, nb] counts and [B, 1, nb, nb] kv block indices, the marked ones first
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=document_causal_mask_mod(seg)
    )


def document_block_mask_host(seg_host: np.ndarray, seg: torch.Tensor, block: int = 128) -> BlockMask:
    """document_block_mask computed with numpy from the batch's host copy of `seg` (the pinned slot), then
    sent to the device in one copy: the same eight block tensors, none of the ~40 small device ops and their
    launches on the training loop's thread (bench/results/overhead-*.md). `seg` is the device copy, which
    the mask_mod of partial blocks reads."""
    B, L = seg_host.shape
    nb = L // block
    s = seg_host.reshape(B, nb, block)
    lo, hi = s[..., 0], s[..., -1]
    i = np.arange(nb)
    before = (i[:, None] > i[None, :])[None]
    shares = hi[:, None, :] >= lo[:, :, None]
    one_doc = lo == hi
    full = before & (one_doc[:, :, None] & one_doc[:, None, :]) & (lo[:, None, :] == lo[:, :, None])
    partial = ((before & shares) | (i[:, None] == i[None, :])[None]) & ~full
    parts: list[np.ndarray] = []
    # kv side, then q side (the transposes, as BlockMask.from_kv_blocks derives them): per row of blocks the
    # count, and the block indices with the marked ones first (a stable sort, like torch.argsort's)
    for m in (partial, full, partial.transpose(0, 2, 1), full.transpose(0, 2, 1)):
        parts += [m.sum(-1, dtype=np.int32), np.argsort(~m, axis=-1, kind="stable").astype(np.int32)]
    flat = torch.from_numpy(np.concatenate([p.ravel() for p in parts])).to(seg.device, non_blocking=True)
    views, at = [], 0
    for p in parts:
        views.append(flat[at : at + p.size].view(B, 1, *p.shape[1:]))
        at += p.size
    kv_num, kv_idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx = views
    return BlockMask(
        seq_lengths=(L, L),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block, block),
        mask_mod=document_causal_mask_mod(seg),
    )


def build_inputs(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    seg: torch.Tensor | None,
    *,
    attention: str = "auto",
    mask_cache: MaskCache | None = None,
    loss_mask: torch.Tensor | None = None,
    seg_host: np.ndarray | None = None,
) -> ModelInputs:
    """tokens/lengths/seg (and loss_mask) already on the model's device. `attention`: auto | flex | dense |
    flash. `seg_host`, the host copy of seg if there is one, lets the block mask (or flash's document offsets)
    be built on the host."""
    B, L = tokens.shape
    idx = tokens.long()
    targets = targets_for(idx, lengths, seg, loss_mask)
    if seg is None:
        pos = torch.arange(L, device=idx.device).expand(B, L)
        return ModelInputs(idx, pos, targets, AttnSpec("causal"))
    seg = seg.to(torch.int32)
    pos = positions(seg)
    if attention == "flash":  # FlashAttention-4 varlen: the documents' offsets, from the host copy of seg
        cu = cu_seqlens_host(seg_host if seg_host is not None else seg.cpu().numpy())
        cu_dev = torch.from_numpy(cu).to(idx.device, non_blocking=True)
        return ModelInputs(idx, pos, targets, AttnSpec("varlen", cu_seqlens=cu_dev))
    use_flex = attention == "flex" or (attention == "auto" and idx.is_cuda)
    if use_flex:
        if L % 128 == 0 and seg_host is not None:
            bm = document_block_mask_host(seg_host, seg)
        elif L % 128 == 0:
            bm = document_block_mask(seg)
        else:  # a partial last block: let FlexAttention's own builder handle the edge
            bm = create_block_mask(document_causal_mask_mod(seg), B, None, L, L, device=idx.device)
        return ModelInputs(idx, pos, targets, AttnSpec("flex", block_mask=bm, seg=seg))
    causal = (
        mask_cache.causal(L, idx.device)
        if mask_cache
        else torch.ones(L, L, dtype=torch.bool, device=idx.device).tril()
    )
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    return ModelInputs(idx, pos, targets, AttnSpec("dense", mask=mask[:, None]))


def empty_inputs(
    pcfg: PipelineConfig, device: torch.device, attention: str, mask_cache: MaskCache
) -> ModelInputs:
    """A batch with no targets, for a rank whose producers are done while other ranks still train:
    under DDP every rank must run the backward that all-reduces the gradients (it adds zeros)."""
    B, T = pcfg.batch_size, pcfg.seq_len
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    lengths = torch.zeros(B, dtype=torch.int32, device=device)
    seg = torch.zeros(B, T, dtype=torch.int32, device=device) if pcfg.strategy == "pack" else None
    return build_inputs(tokens, lengths, seg, attention=attention, mask_cache=mask_cache)
