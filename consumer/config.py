"""The trainer's settings (model, optimisation, precision, checkpoints, logging)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    model: str = "tiny"
    steps: int = 300  # optimizer steps; 0 = until every producer has finished its epochs
    accum: int = 1  # micro-batches (wire batches) per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    lr_decay_steps: int = 0  # 0: `steps`
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    device: str = "auto"
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    loss_scale: str = "dynamic"  # fp16 only: dynamic | static:VALUE | none
    # Fused linear + cross-entropy (liger-kernel, CUDA): ~70x less loss memory, but liger reads a count
    # with .item() every step, a host sync that cost 23% of GPT-2 124M's throughput on an H200
    # (bench/results/ablation-*.md). Worth it when the logits would not fit; off by default.
    fused_ce: bool = False
    vocab_size: int = 0  # model vocabulary; 0: the tokenizer's (rounded up to a multiple of 64)
    attention: str = "auto"  # auto | flex | dense (packed rows)
    fused_adamw: bool = True
    grad_checkpointing: bool = False
    compile: bool = False
    copy_stream: bool = True
    tf32: bool = True  # TF32 matmuls for whatever still runs in fp32
    log_every: int = 10
    slots: int = 0  # host slots; 0: 2 * accum + 2
    threads: int = 0  # torch CPU threads; 0: torch's default
    seed: int = 1337
    metrics_port: int | None = None
    doc_log: str | None = None  # append every trained (worker, seq, doc pieces) as JSON lines
    wait_timeout: float = 0.0  # give up when no batch came for this long (0: wait forever)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0: only at the end and on SIGTERM/SIGINT
    keep_checkpoints: int = 3
    resume: str | None = None  # "auto" | a checkpoint path
