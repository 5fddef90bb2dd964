"""The trainer's settings (model, optimisation, precision, checkpoints, logging).

Each field is one setting (shared/settings.py): flag, LMPIPE_<FLAG> variable, default, help and check.
No torch here: `lmpipe --help` and the parsers stay quick and producers never load it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from lmpipe.consumer.fast import names as fast_paths
from lmpipe.consumer.hf_folder import model_problem
from lmpipe.consumer.sinks import sink_problem
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import at_least, between, positive, setting, validate

MODELS = (
    "tiny",
    "small",
    "gpt2-124m",
    "gpt2-350m",
    "gpt2-774m",
    "gpt2-1558m",
    "wide-1.8b",
)  # consumer/model.PRESETS (tests/test_config.py)
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8")
# torch.compile modes: "reduce-overhead" adds CUDA graphs (launch overhead: small models), "max-autotune"
# tries Triton matmul templates (long compiles), "autotune-attention" (ours) tunes only FlexAttention's tiles
# and leaves the matmuls to cuBLAS. bench/results/ablation-*.md measures each.
COMPILE_MODES = (
    "default",
    "reduce-overhead",
    "max-autotune-no-cudagraphs",
    "max-autotune",
    "autotune-attention",
)
ATTENTIONS = ("auto", "flex", "dense", "flash")
# transformers' attn_implementation for --model DIR (flash_attention_2 needs the flash-attn package)
HF_ATTENTIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2")
TRAINING, CHECKPOINTS, EVALUATION = "training", "checkpoints", "evaluation"


def device_problem(name: str) -> str | None:
    if re.fullmatch(r"auto|cpu|mps|(cuda|xpu)(:\d+)?", name):
        return None
    return "not a device; use auto, cpu, cuda, cuda:N, mps or xpu"


def loss_scale_problem(spec: str) -> str | None:
    if spec in ("dynamic", "none"):
        return None
    if spec.startswith("static:"):
        try:
            if positive(float(spec.split(":", 1)[1])) is None:
                return None
        except ValueError:
            pass
    return "must be dynamic, static:VALUE (VALUE > 0) or none"


def unit_interval(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


@dataclass
class TrainConfig:
    model: str = setting(
        "tiny",
        check=lambda v: model_problem(v, MODELS),
        metavar="PRESET|DIR",
        help=f"model preset ({', '.join(MODELS)}), or a folder with a Hugging Face config.json (and optional "
        "weights: fine-tuning) of a causal LM: Llama, Qwen2, GPT-2, ... (pip install 'lmpipe[hf]')",
    )
    # "How fast can my pipeline go?": everything up to the model's first layer, then nothing. Checkpoints
    # and --doc-log still work (cursors only), so exactly-once can be checked without a GPU's worth of model.
    consume_only: bool = setting(
        False,
        help="receive, validate and copy batches to the device, but build and train no model: "
        "the pipeline's own tokens/s, data wait and time per stage",
    )
    steps: int = setting(
        300, check=at_least(0), help="optimizer steps; 0: until every producer has finished its epochs"
    )
    accum: int = setting(1, check=at_least(1), help="micro-batches (wire batches) per optimizer step")
    keep_global_batch: bool = setting(
        False,
        group=CHECKPOINTS,
        help="resuming a checkpoint of N ranks on M: --accum becomes the checkpoint's x N / M, so that a step "
        "takes as many batches as before (refused where M does not divide them)",
    )
    lr: float = setting(3e-3, check=positive, help="peak learning rate")
    min_lr_ratio: float = setting(0.1, check=between(0, 1), help="cosine floor as a fraction of --lr")
    warmup: int = setting(20, check=at_least(0), help="linear warmup steps")
    lr_decay_steps: int = setting(0, check=at_least(0), help="cosine horizon in steps (0: --steps)")
    weight_decay: float = setting(0.1, check=at_least(0), help="AdamW weight decay (matrices only)")
    beta1: float = setting(0.9, check=unit_interval, help="AdamW beta1")
    beta2: float = setting(0.95, check=unit_interval, help="AdamW beta2")
    grad_clip: float = setting(1.0, check=at_least(0), help="clip the global grad norm (0: off)")
    device: str = setting("auto", check=device_problem, help="auto | cpu | cuda | cuda:N")
    precision: str = setting(
        "auto",
        choices=PRECISIONS,
        help="auto: bf16 on CUDA, fp32 on CPU; fp8: bf16 with torchao float8 matmuls in the blocks (H100/H200)",
    )
    # autocast leaves the residual stream (embeddings, each block's input and output) in fp32; in bf16 the
    # layer norms and residual adds, the memory-bound part of a GPT-2 124M step, move half the bytes: 1.055x
    # at 32 rows on an H100, the loss as fp32's (bench/results/residual-h100-*.md)
    residual_dtype: str = setting(
        "auto",
        choices=("auto", "fp32", "bf16"),
        help="dtype of the residual stream between blocks (auto: bf16 where the matmuls run in bf16, else "
        "fp32; fp32: as autocast leaves it; bf16: with --precision bf16 or fp8 only)",
    )
    loss_scale: str = setting(
        "dynamic", check=loss_scale_problem, metavar="dynamic|static:VALUE|none", help="fp16 loss scaling"
    )
    # Fused linear + cross-entropy (liger-kernel, CUDA): ~70x less loss memory, but liger reads a count
    # with .item() every step, a host sync that cost 23% of GPT-2 124M's throughput on an H200
    # (bench/results/ablation-*.md). Worth it when the logits would not fit; off by default.
    fused_ce: bool = setting(
        False,
        help="liger-kernel's fused linear + cross-entropy on CUDA: far less memory, one host sync a step",
    )
    fast: str = setting(
        "auto",
        check=fast_paths.problem,
        metavar="auto|none|LIST",
        help="fast paths (consumer/fast/): auto: every one on by default that can run here; none: the "
        "reference path; a comma list: exactly those (auto,NAME adds an opt-in one, auto,-NAME leaves one "
        "out). Paths: " + ", ".join(fast_paths.NAMES),
    )
    vocab_size: int = setting(
        0, check=at_least(0), help="model vocabulary (0: the tokenizer's, rounded up to a multiple of 64)"
    )
    attention: str = setting(
        "auto",
        choices=ATTENTIONS,
        help="packed rows: FlexAttention (CUDA default), an exact dense mask, or FlashAttention-4's varlen "
        "kernels (flash: Hopper+, pip install 'lmpipe[flash]')",
    )
    hf_attention: str = setting(
        "sdpa",
        choices=HF_ATTENTIONS,
        help="a Hugging Face model's (--model DIR) attention implementation; packed rows are probed at the "
        "start for one that keeps documents apart",
    )
    fused_adamw: bool = setting(True, help="fused AdamW (--no-fused-adamw: the foreach implementation)")
    grad_checkpointing: bool = setting(False, help="recompute activations in backward")
    compile: bool = setting(False, help="torch.compile the model")
    compile_mode: str = setting(
        "default",
        choices=COMPILE_MODES,
        help="torch.compile mode (reduce-overhead: CUDA graphs; autotune-attention: FlexAttention's tiles "
        "tuned at the first step, matmuls left to cuBLAS)",
    )
    # blocks: each transformer block compiled on its own (regional compilation): Dynamo traces one block and
    # the others reuse its graph, so a compile, cold or from the cache, is seconds shorter; the price is the
    # fusion across block boundaries: 0.977x the throughput (bench/results/compile-scope-h200-2026-11-29.md)
    compile_scope: str = setting(
        "model",
        choices=("model", "blocks"),
        help="with --compile, what one graph holds: the whole model, or each transformer block (blocks: "
        "faster compiles and warm restarts, at some fusion)",
    )
    # A restart (requeue, preemption, crash loop) loads what the last run compiled instead of compiling again:
    # consumer/compile_cache.py, checked against torch, CUDA, the GPU and these settings before it is used
    compile_cache: str = setting(
        "auto",
        check=lambda v: None if v.strip() else "must be auto, off or a folder",
        metavar="auto|off|DIR",
        help="with --compile, where compiled kernels are kept for restarts: auto: compile-cache/ in "
        "--checkpoint-dir (none without it; torch's own cache still serves this host), off, or a folder",
    )
    compile_ahead: bool = setting(
        True,
        help="with --compile, compile on a blank batch while producers connect and fill the slots, instead "
        "of after the first batch arrives (--strategy pack and pad: one shape)",
    )
    # Under torchrun, DDP all-reduces fp32 gradients; bf16 halves the bytes on the wire (torch's
    # bf16_compress_hook: each bucket cast to bf16, averaged, cast back), at bf16's 8-bit mantissa in the sum.
    # On NVLink it is slower (0.934 vs 0.949 per GPU at 4 H200s, bench/results/ddp-*.md): for slow links.
    grad_reduce: str = setting(
        "fp32", choices=("fp32", "bf16"), help="dtype of DDP's gradient all-reduce under torchrun"
    )
    copy_stream: bool = setting(
        True, help="copy batches to the GPU on their own CUDA stream (--no-copy-stream: ablation)"
    )
    tf32: bool = setting(True, help="TF32 matmuls on CUDA for whatever still runs in fp32")
    log_every: int = setting(10, check=at_least(1), help="steps between status lines (and host syncs)")
    slots: int = setting(0, check=at_least(0), help="pinned host slots, at least --accum (0: 2*accum+2)")
    threads: int = setting(0, check=at_least(0), help="torch CPU threads (0: torch's default)")
    seed: int = setting(1337, flag="train-seed", help="model init seed")
    metrics_port: int | None = setting(
        9400,
        check=between(-1, 65535),
        help="Prometheus /metrics port of the trainer (0: any free port, -1: off); "
        "`lmpipe run` gives producer i port+1+i",
    )
    shards: int = setting(
        16,
        check=between(1, 4096),
        help="the corpus is split into this many shards (record id % shards), fixed for the run and its "
        "checkpoints; the trainer spreads them over whichever producers are connected",
    )
    doc_log: str | None = setting(
        None, metavar="FILE", help="append every trained (shard, seq, doc pieces) as JSON lines"
    )
    wait_timeout: float = setting(
        0.0, check=at_least(0), help="stop when no batch arrived for this many seconds (0: wait forever)"
    )
    # held-out loss: the launcher reads the first --eval-batches batches of --eval-data once, with the
    # producers' own reading, tokenizing and batching (lmpipe/evaldata.py); consumer/evaluate.py scores them
    eval_data: list[str] = setting(
        [],
        group=EVALUATION,
        metavar="PATH",
        help="held-out corpus files, directories or prepared shards (anything --data takes): its loss is "
        "measured every --eval-every steps and at the end, on the same batches each time",
    )
    eval_every: int = setting(
        100, group=EVALUATION, check=at_least(1), metavar="STEPS", help="steps between evaluations"
    )
    eval_batches: int = setting(
        8,
        group=EVALUATION,
        check=between(1, 100_000),
        metavar="K",
        help="batches of --eval-data each evaluation scores (the first K, in order: the same each time)",
    )
    log_to: list[str] = setting(
        [],
        check=lambda v: next((why for s in v if (why := sink_problem(s))), None),
        metavar="tensorboard:DIR|wandb[:PROJECT]",
        help="also log the run's figures (each logging interval, each evaluation) to TensorBoard event files "
        "in DIR or to a Weights & Biases run, offline unless WANDB_MODE=online (optional extras: pip install "
        "'lmpipe[tensorboard]' or 'lmpipe[wandb]')",
    )
    checkpoint_dir: str | None = setting(
        None, group=CHECKPOINTS, metavar="DIR", help="where checkpoints go (none: no checkpoints)"
    )
    checkpoint_every: int = setting(
        0,
        group=CHECKPOINTS,
        check=at_least(0),
        metavar="STEPS",
        help="also checkpoint every STEPS steps (always: at the end and on SIGTERM/SIGINT)",
    )
    keep_checkpoints: int = setting(
        3, group=CHECKPOINTS, check=at_least(1), metavar="K", help="keep the last K checkpoints"
    )
    # async: the step loop waits only for a copy of the state into host memory (pinned, allocated once: the
    # size of the model and optimizer state); a thread writes it (consumer/checkpoint_async.py, docs/checkpoints.md)
    checkpoint_mode: str = setting(
        "auto",
        group=CHECKPOINTS,
        choices=("auto", "async", "sync"),
        help="async: copy the state to host memory at the step, then write it in the background while "
        "training goes on (one write at a time); sync: stop training until it is written; auto: async on "
        "CUDA, sync on CPU",
    )
    resume: str | None = setting(
        None,
        group=CHECKPOINTS,
        metavar="auto|PATH",
        help="auto: the latest checkpoint in --checkpoint-dir if any; PATH: that checkpoint",
    )

    def __post_init__(self) -> None:
        validate(self)

    def cross_check(self) -> list[str]:
        out = []
        if self.slots and self.slots < self.accum:
            out.append(f"--slots {self.slots} is fewer than --accum {self.accum}: a step holds --accum slots")
        if self.resume == "auto" and not self.checkpoint_dir:
            out.append("--resume auto needs --checkpoint-dir")
        # said before any producer starts; on a GPU or auto device the trainer checks with torch
        if self.device == "cpu" and self.precision == "fp8":
            out.append("--precision fp8 needs a GPU with FP8 matmuls; --device cpu is the CPU")
        cpu_auto = self.precision == "auto" and self.device == "cpu"  # auto is fp32 on a CPU
        if self.residual_dtype == "bf16" and (self.precision in ("fp32", "fp16") or cpu_auto):
            given = "auto, which is fp32 on --device cpu" if cpu_auto else self.precision
            out.append(f"--residual-dtype bf16 needs --precision bf16 or fp8, not {given}")
        if self.device == "cpu" and self.attention == "flash":
            out.append("--attention flash needs a CUDA GPU; --device cpu is the CPU")
        if self.device == "cpu" and fast_paths.problem(self.fast) is None:
            named = fast_paths.parse(self.fast).add
            if cuda := [p.name for p in fast_paths.PATHS if p.cuda and p.name in named]:
                out.append(f"--fast {cuda[0]} needs a CUDA GPU; --device cpu is the CPU")
        return out


def per_rank(
    pcfg: PipelineConfig, tcfg: TrainConfig, rank: int, world: int
) -> tuple[PipelineConfig, TrainConfig]:
    """Rank r of R (torchrun) binds port + 2r, serves metrics after the lower ranks' trainer and
    producers, logs its documents to its own file, and expects producers of rank r. No torch: the
    launcher starts a rank's producers before it imports torch (lmpipe/launch.py)."""
    if pcfg.world_size not in (1, world) or (pcfg.world_size == world and pcfg.rank not in (0, rank)):
        raise ValueError(
            f"--rank/--world-size {pcfg.rank}/{pcfg.world_size} disagree with torchrun's {rank}/{world}; "
            "leave them out under torchrun"
        )
    pcfg = replace(pcfg, rank=rank, world_size=world, port=pcfg.port + 2 * rank)
    metrics = tcfg.metrics_port
    if metrics and metrics > 0:  # 0 (any free port) and -1/None (off) stay as they are
        metrics += rank * (pcfg.producers + 1)
    doc_log = tcfg.doc_log
    if doc_log:
        path = Path(doc_log)
        doc_log = str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))
    return pcfg, replace(tcfg, metrics_port=metrics, doc_log=doc_log)
