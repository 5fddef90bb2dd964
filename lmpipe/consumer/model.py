"""A GPT-2-like language model in one file (after nanoGPT), with document-aware attention.

Rows come in two kinds. Padded rows hold one document each, padded on the right: plain causal attention
is exact for the real tokens (they never look right), so they take SDPA with is_causal=True (FlashAttention
on CUDA). Packed rows hold several documents; `seg` says which token belongs to which,
and attention is causal *within* a document only. That mask is built once per batch (`AttnSpec`) and
shared by every layer: on CUDA as a FlexAttention block mask (or, with `--attention flash`, as the documents'
offsets for FlashAttention-4: consumer/fast/flash.py), elsewhere as an exact boolean mask for SDPA.
Position ids restart at every document so a packed document sees the same positions it would alone.

This is the reference path (`--fast none`). The one hook for the fast paths: consumer/fast/ may give a module
a subclass of its class (fast.mix) that overrides `GPT.loss`, `CausalSelfAttention.project` or `.attend`, or
`MLP.forward`; parameters, state dict and initialisation stay these.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

IGNORE = -100


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=256, n_layer=2, n_head=4, n_embd=128),  # CPU tests and the default run
    "small": GPTConfig(block_size=512, n_layer=6, n_head=6, n_embd=384),
    "gpt2-124m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1558m": GPTConfig(block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    # a 7B model's width in 8 layers: matmuls as large as those torchao's float8 speed-ups are quoted for,
    # so --precision fp8 can be measured where it is meant to pay (bench/results/fp8-*.md)
    "wide-1.8b": GPTConfig(block_size=1024, n_layer=8, n_head=32, n_embd=4096),
}


def preset(name: str, vocab_size: int | None = None, block_size: int | None = None) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if vocab_size is not None:
        cfg = replace(cfg, vocab_size=-(-vocab_size // 64) * 64)  # multiple of 64: faster matmuls
    if block_size is not None:
        cfg = replace(cfg, block_size=block_size)
    return cfg


@dataclass
class AttnSpec:
    """How attention is masked for one batch; built once, used by every layer."""

    kind: str  # "causal" | "dense" | "flex" | "varlen"
    mask: torch.Tensor | None = None  # dense: bool [B, 1, L, L], True = may attend
    block_mask: object | None = None  # flex: torch.nn.attention.flex_attention.BlockMask
    cu_seqlens: torch.Tensor | None = None  # varlen: int32 document starts (inputs.cu_seqlens_host)
    seg: torch.Tensor | None = None  # flex: the document ids its mask_mod reads (a step graph copies them)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn: AttnSpec) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = (t.view(B, L, self.n_head, C // self.n_head) for t in self.project(x))
        y = self.attend(q, k, v, attn)
        return self.resid_dropout(self.c_proj(y.contiguous().view(B, L, C)))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, each [B, L, C]."""
        return self.c_attn(x).split(x.size(-1), dim=2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttnSpec) -> torch.Tensor:
        """q, k, v: [B, L, H, D] -> [B, L, H, D]"""
        if attn.kind == "varlen":
            raise ValueError("varlen inputs (--attention flash) need consumer/fast/flash.py's attention")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        if attn.kind == "flex":
            flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
            y = flex(q, k, v, block_mask=attn.block_mask)
        elif attn.kind == "dense":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn.mask, dropout_p=drop)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return y.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, attn: AttnSpec) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class Trunk(nn.Module):
    """Embeddings, blocks and final norm. Registered in the order of nanoGPT's ModuleDict it replaces, so
    checkpoint keys (transformer.wte.weight, ...), parameter order and initialisation are unchanged; a
    module of its own so that each part has a type."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


class GPT(nn.Module):
    def __init__(
        self, cfg: GPTConfig, grad_checkpointing: bool = False, residual_dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.config = cfg
        self.transformer = Trunk(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.grad_checkpointing = grad_checkpointing  # recompute each block's activations in backward
        self.residual_dtype = residual_dtype  # None: as autocast leaves it (fp32)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def hidden(self, idx: torch.Tensor, pos: torch.Tensor, attn: AttnSpec) -> torch.Tensor:
        """Final hidden states [B, L, C] (before the LM head)."""
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if self.residual_dtype is not None:  # the blocks' bf16 outputs then keep the stream in bf16
            x = x.to(self.residual_dtype)
        for block in self.transformer.h:
            if self.grad_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, attn, use_reentrant=False)
            else:
                x = block(x, attn)
        return self.transformer.ln_f(x)

    def forward(
        self, idx: torch.Tensor, pos: torch.Tensor, attn: AttnSpec, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns (logits, summed loss over targets != IGNORE). Logits are None when targets are given,
        so training never keeps the [B, L, vocab] tensor around longer than the loss needs it."""
        h = self.hidden(idx, pos, attn)
        if targets is None:
            return self.lm_head(h), None
        return None, self.loss(h, targets)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The LM head and its cross-entropy, summed over targets != IGNORE; h [B, L, C]."""
        logits = self.lm_head(h)
        return F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B: 6N + 12 * layers * dim * seq_len)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * seq_len


@functools.cache
def _compiled_flex_attention():
    """FlexAttention for eager models, compiled once: uncompiled it runs a slow reference path. A
    compiled model calls flex_attention directly and compiles it with everything else."""
    return torch.compile(flex_attention, dynamic=False)
