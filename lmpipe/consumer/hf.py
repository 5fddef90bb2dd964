"""Any Hugging Face causal LM in lmpipe's trainer (`--model DIR`: a folder with a `transformers` config.json,
and optional weights to fine-tune from).

`HFCausalLM` wraps the `transformers` model in the trainer's model contract (consumer/step.py):
`model(idx, pos, attn, targets) -> (logits or None, loss summed over targets != IGNORE)`, targets already
shifted (consumer/inputs.py). It runs the base model to its hidden states, then the LM head and the
cross-entropy, as GPT.loss does; and it has what the trainer reads of lmpipe's GPT: `config` (the
checkpoint's identity), `num_params()` and `flops_per_token()`.

Packed rows must not attend across documents. How a model keeps them apart depends on the model, its
attention implementation and the transformers version, so it is tested, not assumed: at build a probe packs
two documents into one short row and changes the first; the second's logits must not move. It tries the
documents' position ids (restarting at each document; transformers reads packed sequences from them when
there is no cache and no mask), then a 4D boolean mask (same document and causal), and refuses
`--strategy pack` where neither keeps them apart. One line at the start says which.

Nothing is downloaded: the config and weights are read from the folder only, and a config that needs the
folder's own code (trust_remote_code) is refused. transformers is imported here only, when --model names a
folder: `import lmpipe` and lmpipe's GPT never load it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmpipe.consumer.hf_folder import (
    HF_EXTRA,
    max_positions,
    read_config,
    remote_code_refusal,
    size_problem,
)
from lmpipe.consumer.model import IGNORE, AttnSpec

log = logging.getLogger("lmpipe.trainer")

POSITION_IDS, MASK, NONE = "position_ids", "mask", "none"
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# config.json keys that say how a file was written, not what the model is: left out of the identity
NOT_IDENTITY = (
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "attn_implementation",
)


def import_transformers(folder: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"--model {folder}: a Hugging Face model folder needs transformers: {HF_EXTRA}"
        ) from None
    return transformers


def document_mask(pos: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool, True where a token may attend: earlier or same positions of its own document. A
    document starts where its position restarts at 0 (inputs.positions)."""
    seg = (pos == 0).cumsum(-1)
    L = pos.size(-1)
    causal = torch.ones(L, L, dtype=torch.bool, device=pos.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


class HFCausalLM(nn.Module):
    """A transformers causal LM under the trainer's model contract."""

    hugging_face = True  # the fast paths (consumer/fast/) read lmpipe's GPT's modules: not for this one
    model: Any  # the transformers PreTrainedModel (untyped here)

    def __init__(self, model: nn.Module, identity: dict[str, Any], name: str):
        super().__init__()
        self.model = model
        self.config = identity  # the checkpoint's identity (trainer._identity)
        self.name = name  # e.g. "Llama (sdpa)", for the log
        self.packing = POSITION_IDS  # how packed rows keep documents apart (probe())
        self.head_exact = True  # whether the logits are the LM head of the hidden states (check_head())
        self.weights = "initialised from config.json"  # or "its weights": fine-tuning

    @property
    def base(self) -> Any:
        return self.model.base_model  # a property: an attribute would register the module twice

    def _kwargs(self, idx: torch.Tensor, pos: torch.Tensor, attn: AttnSpec) -> dict[str, Any]:
        kw: dict[str, Any] = {"input_ids": idx, "use_cache": False}
        if attn.kind != "causal":  # packed rows (unpacked ones take the model's own causal positions)
            if self.packing == NONE:
                raise ValueError(
                    f"packed rows: {self.name} keeps no documents apart; use --strategy pad or bucket"
                )
            kw["position_ids"] = pos
            if self.packing == MASK:
                kw["attention_mask"] = document_mask(pos)
        return kw

    def forward(
        self, idx: torch.Tensor, pos: torch.Tensor, attn: AttnSpec, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) without targets; (None, summed loss over targets != IGNORE) with them."""
        kw = self._kwargs(idx, pos, attn)
        if not self.head_exact:  # a model whose logits are more than its head (soft-capped, scaled)
            logits = self.model(**kw).logits
        else:
            logits = self.model.get_output_embeddings()(self.base(**kw)[0])
        if targets is None:
            return logits, None
        return None, F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (tied ones once), less the input embeddings where they are not the head's weight
        and any position table: the 6N of flops_per_token, as GPT.num_params counts it."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        head = self.model.get_output_embeddings()
        inputs = self.model.get_input_embeddings()
        for m in self.model.modules():
            if isinstance(m, nn.Embedding) and (
                m is not inputs or head is None or m.weight is not head.weight
            ):
                n -= m.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B: 6N + 12 * layers * dim * seq_len)."""
        cfg = self.model.config
        return 6 * self.num_params() + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def identity(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as the checkpoint compares it: the file's own keys (stable across transformers versions,
    which fill in other defaults), less those that say how it was written."""
    return json.loads(json.dumps({k: v for k, v in raw.items() if k not in NOT_IDENTITY}, default=str))


def _config(folder: str, raw: dict[str, Any]):
    transformers = import_transformers(folder)
    try:
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # one line: an unknown model_type, a config the folder's code would have to read
        if "auto_map" in raw:
            raise ValueError(remote_code_refusal(folder)) from None
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(
            f"--model {folder}: transformers {transformers.__version__} cannot read its config ({why})"
        ) from None


def load(folder: str, attention: str, grad_checkpointing: bool) -> HFCausalLM:
    """The folder's model on the CPU in fp32: its weights where the folder has some, else initialised from
    its config (under the trainer's seed)."""
    raw = read_config(folder)
    transformers = import_transformers(folder)
    config = _config(folder, raw)
    auto = transformers.AutoModelForCausalLM
    has_weights = any((Path(folder) / w).is_file() for w in WEIGHTS)
    try:
        if has_weights:
            model = auto.from_pretrained(folder, config=config, local_files_only=True, trust_remote_code=False,
                                         attn_implementation=attention, dtype=torch.float32)  # fmt: skip
        else:
            model = auto.from_config(config, attn_implementation=attention, dtype=torch.float32)
    except (ValueError, OSError, ImportError, KeyError, RuntimeError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--model {folder}: transformers cannot build a causal LM of it ({why})") from None
    if grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"--grad-checkpointing: {type(model).__name__} does not support it")
        # activation_checkpointing_enable: transformers' newer name (the old one warns it goes in v6)
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})  # its first parameter under either name
    arch = type(model).__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    adapter = HFCausalLM(model, identity(raw), f"{arch} ({attention})")
    if has_weights:
        adapter.weights = "its weights"
    return adapter


def check_sizes(model: HFCausalLM, folder: str, tokenizer_vocab: int, seq_len: int) -> None:
    cfg = model.model.config
    positions = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(positions, int):
        positions = max_positions(cfg.to_dict())
    if why := size_problem(folder, int(cfg.vocab_size), positions, tokenizer_vocab, seq_len):
        raise ValueError(why)


def _probe_rows(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of two 4-token documents that differ only in the first document, and their positions."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (1, 8), generator=g)
    b = a.clone()
    b[:, :4] = (a[:, :4] + torch.randint(1, vocab, (1, 4), generator=g)) % vocab
    pos = torch.arange(4).repeat(2)[None]
    return a.to(device), b.to(device), pos.to(device)


@torch.no_grad()
def isolates(model: HFCausalLM, packing: str, autocast_dtype: torch.dtype | None) -> bool:
    """Whether packed rows keep documents apart with `packing`: the second document's logits do not move when
    the first document changes (by less than 1e-3 of how much the first document's own logits move)."""
    device = next(model.parameters()).device
    a, b, pos = _probe_rows(int(model.model.config.vocab_size), device)
    was_training, before = model.training, model.packing
    model.eval()  # no dropout
    model.packing = packing
    try:
        with torch.autocast(
            device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
        ):
            la, lb = (model(x, pos, AttnSpec("dense"))[0].float() for x in (a, b))
    except Exception as exc:  # an implementation that cannot take this input (a 4D mask, say)
        log.debug("packing probe %s: %s", packing, exc)
        return False
    finally:
        model.packing = before
        model.train(was_training)
    change = (la[:, :4] - lb[:, :4]).abs().max()
    leak = (la[:, 4:] - lb[:, 4:]).abs().max()
    return bool(change > 0 and leak <= 1e-3 * change)


@torch.no_grad()
def check_head(model: HFCausalLM) -> None:
    """Whether the model's logits are its LM head of the last hidden states (most are; some soft-cap or
    scale them): where not, the adapter takes the whole model's logits."""
    device = next(model.parameters()).device
    a, _, _ = _probe_rows(int(model.model.config.vocab_size), device)
    was_training = model.training
    model.eval()
    try:
        whole = model.model(input_ids=a, use_cache=False).logits
        head = model.model.get_output_embeddings()
        model.head_exact = head is not None and torch.allclose(head(model.base(input_ids=a, use_cache=False)[0]), whole,
                                                               rtol=1e-4, atol=1e-5)  # fmt: skip
    finally:
        model.train(was_training)


def choose_packing(model: HFCausalLM, strategy: str, autocast_dtype: torch.dtype | None) -> str:
    """Pick how packed rows keep documents apart (probe), set it on the model, and say it in one line;
    ValueError (one line) for --strategy pack where nothing keeps them apart."""
    if strategy != "pack":
        model.packing = NONE
        log.info("rows: one document each (--strategy %s), %s needs no document mask", strategy, model.name)
        return NONE
    for packing, how in ((POSITION_IDS, "by position_ids"), (MASK, "by a 4D document mask")):
        if isolates(model, packing, autocast_dtype):
            model.packing = packing
            log.info("packed rows: %s isolates documents %s", model.name, how)
            return packing
    raise ValueError(
        f"--strategy pack: {model.name} lets packed documents attend to each other (neither position_ids nor a "
        "4D document mask keeps them apart); use --strategy pad or bucket, or another --hf-attention"
    )


def build_model(folder: str, *, attention: str, grad_checkpointing: bool, tokenizer_vocab: int, seq_len: int,
                strategy: str, device: torch.device, autocast_dtype: torch.dtype | None) -> HFCausalLM:  # fmt: skip
    """The folder's model on `device`, checked (vocabulary, positions) and probed (packing)."""
    if attention == "flex_attention" and device.type != "cuda":
        raise ValueError("--hf-attention flex_attention needs a CUDA GPU; on the CPU use sdpa")
    model = load(folder, attention, grad_checkpointing)
    check_sizes(model, folder, tokenizer_vocab, seq_len)
    model.to(device)
    check_head(model)
    choose_packing(model, strategy, autocast_dtype)
    log.info("--model %s: %s, %.2fM parameters, %s", folder, type(model.model).__name__,
             model.num_params(non_embedding=False) / 1e6, model.weights)  # fmt: skip
    return model


def model_identity(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint must match of the model: GPTConfig's fields, or a Hugging Face config.json's."""
    from dataclasses import asdict

    cfg: Any = model.config
    return dict(cfg) if isinstance(cfg, dict) else asdict(cfg)
