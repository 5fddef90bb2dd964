"""What the trainer trains with: the GPT (or a Hugging Face model, --model DIR: consumer/hf.py), its optimizer
and loss scaler, the DDP and compile wrappers around it, and the step runner over them (consumer/step.py): the
reference path, then the fast paths that --fast picks (consumer/fast/)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, cast

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lmpipe.consumer import fast
from lmpipe.consumer.built import Built
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import flash, liger
from lmpipe.consumer.hf_folder import is_folder, read_config
from lmpipe.consumer.model import GPT, PRESETS, preset
from lmpipe.consumer.scaler import make_scaler
from lmpipe.consumer.step import StepRunner, make_optimizer, to_float8
from lmpipe.shared.config import PipelineConfig

log = logging.getLogger("lmpipe.trainer")

# --compile-mode autotune-attention: max-autotune-no-cudagraphs's inductor options with the matmuls left to
# cuBLAS (ATen), which full max-autotune picks anyway after minutes of tuning; what is tuned is
# FlexAttention's tiles, about 20 s at the first step. 1.03x on GPT-2 124M on an H100 and an H200
# (bench/results/ablation-*.md).
AUTOTUNE_ATTENTION: dict[str, Any] = {
    "max_autotune": True,
    "coordinate_descent_tuning": True,
    "max_autotune_gemm_backends": "ATEN",
}


def available_memory(device: torch.device) -> int | None:
    """Bytes a step can allocate on `device`: the GPU's free memory, or the host's MemAvailable (Linux); None
    where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_step_memory(pcfg: PipelineConfig, tcfg: TrainConfig, vocab_size: int, device: torch.device,
                      autocast_dtype) -> None:  # fmt: skip
    """Refuse a micro-batch whose logits alone cannot fit where it trains: a lower bound on a step's memory
    (the activations and their gradients come on top), so a --batch-size out of reach is one line at the
    start, not the out-of-memory kill minutes later. liger's fused loss (--fused-ce) never holds
    the whole logits, so it is not checked."""
    if tcfg.fused_ce and device.type == "cuda":
        return
    itemsize = torch.finfo(autocast_dtype).bits // 8 if autocast_dtype is not None else 4
    vocab = max(tcfg.vocab_size, vocab_size)
    logits = pcfg.batch_size * pcfg.seq_len * vocab * itemsize
    free = available_memory(device)
    if free is not None and logits > free:
        gib = 1024**3
        raise ValueError(
            f"--batch-size {pcfg.batch_size} x --seq-len {pcfg.seq_len}: a micro-batch's logits alone take "
            f"{logits / gib:,.1f} GiB (vocabulary {vocab:,}, {itemsize} bytes each), and {device.type} has "
            f"{free / gib:.1f} GiB free; lower --batch-size (--accum keeps the step's batch)"
        )


def residual_dtype(
    tcfg: TrainConfig, device: torch.device, precision: str, autocast_dtype
) -> torch.dtype | None:
    """The residual stream's dtype (--residual-dtype): bf16 where the matmuls run in bf16, else None (fp32)."""
    if tcfg.residual_dtype != "fp32" and autocast_dtype == torch.bfloat16:
        return torch.bfloat16
    if tcfg.residual_dtype == "bf16":  # --precision auto on a CPU (fp32 and fp16 by name: cross_check)
        log.warning("--residual-dtype bf16 needs bf16 matmuls; %s trains in %s, the stream stays fp32",
                    device.type, precision)  # fmt: skip
    return None


def wrap(model: torch.nn.Module, pcfg: PipelineConfig, tcfg: TrainConfig, device: torch.device, dist: Dist):
    """(what the step calls, DDP's no_sync or None, the stream DDP was built on or None): the model under DDP
    (torchrun) and/or torch.compile."""
    step_model: torch.nn.Module = model
    no_sync = capture = None
    if dist.enabled:
        # 100 MB buckets: compiled under DDP, the graph is split at every bucket (DDPOptimizer, so that the
        # all-reduce overlaps backward); fewer splits kept more fusion. GPT-2 124M on 4 H100s, 2 ranks:
        # 0.945 of 2x one GPU vs 0.919 at the default 25 MB (bench/results/ddp-*.md).
        # built on the stream that will capture the step as CUDA graphs (consumer/fast/step_graph.py): the
        # reducer keeps the parameters' gradient accumulators, whose stream a capture must share
        capture = torch.cuda.Stream(device) if device.type == "cuda" else None
        if capture is not None:
            capture.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(capture) if capture is not None else contextlib.nullcontext():
            ddp = DistributedDataParallel(
                model,
                device_ids=[device] if device.type == "cuda" else None,
                bucket_cap_mb=100,
                gradient_as_bucket_view=True,
            )
        if capture is not None:
            torch.cuda.current_stream(device).wait_stream(capture)
        if tcfg.grad_reduce == "bf16":
            if device.type != "cuda":  # torch's hook needs NCCL
                raise ValueError("--grad-reduce bf16 needs CUDA GPUs (NCCL); on CPU leave it at fp32")
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        step_model, no_sync = ddp, ddp.no_sync
    if tcfg.compile and pcfg.strategy in ("bucket", "pad-batch") and pcfg.pad_multiple == 1:
        log.warning("--compile with --strategy %s: every row width is a new graph; "
                    "bound them with --pad-multiple (e.g. 64)", pcfg.strategy)  # fmt: skip
    if tcfg.compile:
        # one graph per row width: pack/pad have one, bucket/pad-batch as many as --pad-multiple allows
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        how: dict[str, Any] = (
            {"options": AUTOTUNE_ATTENTION}
            if tcfg.compile_mode == "autotune-attention"
            else {"mode": None if tcfg.compile_mode == "default" else tcfg.compile_mode}
        )
        # blocks: compiled in place, so that DDP and the step call the model as they would uncompiled
        if tcfg.compile_scope == "blocks":
            for block in blocks(model):
                block.compile(dynamic=False, **how)
        else:
            step_model = cast(torch.nn.Module, torch.compile(step_model, dynamic=False, **how))
    return step_model, no_sync, capture


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks that --compile-scope blocks compiles one by one: lmpipe's GPT's, or a
    Hugging Face model's decoder layers (the classes its _no_split_modules names)."""
    if isinstance(model, GPT):
        return list(model.transformer.h)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"--compile-scope blocks: {type(model).__name__} names no repeated block class "
                         "(_no_split_modules); use --compile-scope model")  # fmt: skip
    return found


def build(
    pcfg: PipelineConfig,
    tcfg: TrainConfig,
    vocab_size: int,
    device: torch.device,
    precision: str,
    autocast_dtype,
    dist: Dist,
) -> Built:
    """The reference GPT (or --model DIR's Hugging Face model), its optimizer and loss scaler, DDP and compile
    wrappers and the step runner; then --attention flash, --fused-ce and the fast paths that --fast picks,
    swapped into them (consumer/fast/). torch.compile traces at the first step, so what the paths swap in is
    what it compiles."""
    hf_dir = is_folder(tcfg.model, list(PRESETS))
    hf_vocab = read_config(tcfg.model).get("vocab_size") if hf_dir else None
    # before anything is allocated
    check_step_memory(
        pcfg, tcfg, hf_vocab if isinstance(hf_vocab, int) else vocab_size, device, autocast_dtype
    )
    if tcfg.attention == "flash" and not hf_dir and (why := flash.problem(device)):
        raise ValueError(why)
    if not hf_dir and tcfg.hf_attention != "sdpa":
        log.warning("--hf-attention %s has no effect on lmpipe's GPT (--model %s): it is for --model DIR",
                    tcfg.hf_attention, tcfg.model)  # fmt: skip
    model: torch.nn.Module = (
        hf_model(pcfg, tcfg, vocab_size, device, autocast_dtype)
        if hf_dir
        else gpt_model(pcfg, tcfg, vocab_size, device, precision, autocast_dtype)
    )
    if precision == "fp8":
        if n_fp8 := to_float8(model):
            log.info("fp8: %d linear layers use torchao float8 matmuls", n_fp8)
        else:
            log.warning("fp8: no linear layer of --model %s is large enough for float8 to pay; it trains in bf16",
                        tcfg.model)  # fmt: skip
    optimizer = make_optimizer(model, tcfg, device)
    scaler = make_scaler(tcfg.loss_scale, device) if precision == "fp16" else None
    if scaler is not None and not getattr(optimizer, "_step_supports_amp_scaling", False):
        log.warning("fp16 with a non-fused optimizer: the scaler reads found_inf on the host every step")
    step_model, no_sync, capture = wrap(model, pcfg, tcfg, device, dist)
    runner = StepRunner(
        step_model, optimizer, tcfg, autocast_dtype, scaler, no_sync=no_sync, strategy=pcfg.strategy
    )
    if dist.enabled:  # ranks capture the step as CUDA graphs together or not at all (fast/step_graph.py)
        runner.all_ranks = dist.all
        runner.capture_stream = capture
    # a Hugging Face model is no GPT, but the trainer reads only what both have (parameters, state dict,
    # config, num_params, flops_per_token), and the paths that read GPT's modules refuse it (fast.unavailable)
    built = Built(
        cast(GPT, model), optimizer, scaler, step_model, runner, tcfg, device, precision, autocast_dtype
    )
    if tcfg.attention == "flash" and not hf_dir:
        flash.apply(built)
    if tcfg.fused_ce and not hf_dir:
        liger.apply_setting(built)
    fast.apply_all(tcfg.fast, built)
    return built


def gpt_model(pcfg: PipelineConfig, tcfg: TrainConfig, vocab_size: int, device: torch.device, precision: str,
              autocast_dtype) -> GPT:  # fmt: skip
    """lmpipe's GPT of --model's preset."""
    mcfg = preset(tcfg.model, vocab_size=max(tcfg.vocab_size, vocab_size), block_size=pcfg.seq_len)
    residual = residual_dtype(tcfg, device, precision, autocast_dtype)
    # made and initialised where it trains: on the CPU, drawing 124M parameters and copying them over took
    # 1.5 s of every start (a warm restart's too, whose weights the checkpoint then replaces); on a GPU, ms
    with device:
        return GPT(mcfg, grad_checkpointing=tcfg.grad_checkpointing, residual_dtype=residual)


def hf_model(pcfg: PipelineConfig, tcfg: TrainConfig, vocab_size: int, device: torch.device,
             autocast_dtype) -> torch.nn.Module:  # fmt: skip
    """--model DIR's Hugging Face model (consumer/hf.py); lmpipe's GPT-only settings are refused or said to
    do nothing, each in one line."""
    from lmpipe.consumer import hf

    if tcfg.attention == "flash":
        raise ValueError("--attention flash is lmpipe's GPT's; a Hugging Face model attends with its own "
                         "implementation (--hf-attention)")  # fmt: skip
    if tcfg.attention != "auto":
        log.warning("--attention %s has no effect on a Hugging Face model: it attends with --hf-attention %s",
                    tcfg.attention, tcfg.hf_attention)  # fmt: skip
    if tcfg.fused_ce:
        log.warning("--fused-ce has no effect on a Hugging Face model: its loss is torch's cross-entropy")
    if tcfg.residual_dtype == "bf16":
        log.warning(
            "--residual-dtype bf16 has no effect on a Hugging Face model: autocast decides its dtypes"
        )
    if tcfg.vocab_size:
        log.warning("--vocab-size %d has no effect on a Hugging Face model: its config.json's vocab_size holds",
                    tcfg.vocab_size)  # fmt: skip
    return hf.build_model(
        tcfg.model, attention=tcfg.hf_attention, grad_checkpointing=tcfg.grad_checkpointing,
        tokenizer_vocab=max(tcfg.vocab_size, vocab_size), seq_len=pcfg.seq_len, strategy=pcfg.strategy,
        device=device, autocast_dtype=autocast_dtype,
    )  # fmt: skip
