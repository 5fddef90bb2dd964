"""Measuring the trainer: fed by the real pipeline, or by batches already on the device.

Both paths run the same Trainer (model, optimizer, step function, input building); the only difference
is where batches come from. Pipeline: producer processes + ZeroMQ + pinned slots + copy stream.
Synthetic: a few real batches copied to the device once, replayed. The first `warmup` steps (compile,
allocator warm-up) are not timed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import WIKITEXT, free_port_pair, smoke_out, start_producers, stop
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.inputs import build_inputs
from lmpipe.consumer.report import peak_flops
from lmpipe.consumer.step import lr_at
from lmpipe.consumer.trainer import Trainer
from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.shards import is_shard_dir, prepare
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.config import PipelineConfig, pipeline_argv
from lmpipe.shared.files import SHARD_META
from lmpipe.shared.tokenizer import load_tokenizer, train_tokenizer


def mfu(tokens_per_second: float, flops_per_token: float) -> float:
    """Model FLOPs utilisation against the card's dense bf16 peak (the trainer's table); 0 off CUDA."""
    peak = peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else 0.0
    return tokens_per_second * flops_per_token / peak if peak else 0.0


@dataclass
class Result:
    tokens_per_second: float
    step_ms: float
    data_wait: float
    mfu: float
    peak_memory_gib: float
    compiled_graphs: int = 0
    final_loss: float = float("nan")  # the last logged interval's loss


def bench_data(work: Path, vocab: int = 32768) -> tuple[str, str]:
    """A WikiText-2 tokenizer and shards of WikiText-2 valid+test, built once under `work`."""
    work.mkdir(parents=True, exist_ok=True)
    files = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    tok_path = work / f"wt2-{vocab}.json"
    if not tok_path.exists():
        texts = [r.text for r in Corpus(files).records() if r.bad is None]
        train_tokenizer(texts, vocab).save(str(tok_path))
    shards = work / f"wt2-shards-{vocab}"
    # shards from before meta.json recorded the tokenizer's facts are made again: runs parse no tokenizer
    if not is_shard_dir(shards) or "tokenizer" not in json.loads((shards / SHARD_META).read_text()):
        tok = load_tokenizer(tok_path)
        prepare(DocStream(Corpus(files), tok, shuffle_window=0), shards, force=True, progress=False)
    return str(tok_path), str(shards)


def pipeline_config(data: str, tokenizer: str, args: argparse.Namespace, **over) -> PipelineConfig:
    cfg = PipelineConfig(
        data=[data],
        tokenizer=tokenizer,
        strategy="pack",
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        producers=args.producers,
        port=free_port_pair(),
        shuffle_window=1000,
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def train_config(args: argparse.Namespace, **over) -> TrainConfig:
    cfg = TrainConfig(
        model=args.model,
        steps=args.warmup + args.steps,
        lr=args.lr,
        warmup=10,
        precision=args.precision,
        compile=args.compile,
        compile_mode=args.compile_mode,
        residual_dtype=args.residual_dtype,
        vocab_size=args.vocab_size,
        fused_ce=args.fused_ce,
        log_every=10,
        metrics_port=None,
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _reset() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def measure_pipeline(pcfg: PipelineConfig, tcfg: TrainConfig, warmup: int) -> Result:
    _reset()
    trainer = Trainer(pcfg, tcfg)
    flops = trainer.model.flops_per_token(pcfg.seq_len)
    procs = start_producers(pipeline_argv(pcfg), pcfg.producers)
    records: list[dict] = []
    try:
        summary = trainer.run(progress=lambda step, st: records.append(dict(st)))
    finally:
        stop(procs)
    timed = [r for r in records if r["step"] - tcfg.log_every >= warmup]
    seconds = sum(r["step_seconds"] * tcfg.log_every for r in timed)
    tokens = sum(r["tokens_per_second"] * r["step_seconds"] * tcfg.log_every for r in timed)
    wait = sum(r["data_wait"] * r["step_seconds"] * tcfg.log_every for r in timed)
    tps = tokens / seconds
    res = Result(
        tps,
        1e3 * seconds / (len(timed) * tcfg.log_every),
        wait / seconds,
        mfu(tps, flops),
        _peak(),
        summary.compiled_graphs,
        records[-1]["loss"] if records else float("nan"),
    )
    del trainer
    return res


def device_batches(pcfg: PipelineConfig, n: int, device: torch.device):
    """n real batches of the same corpus and settings, on the device (host-side work done up front)."""
    tok = load_tokenizer(pcfg.tokenizer)
    stream = DocStream(Corpus(pcfg.data), tok, seed=pcfg.seed, shuffle_window=pcfg.shuffle_window)
    spec = BatchSpec.of(pcfg)
    out = []
    for b in batches(stream, spec, dtype=token_dtype(tok.vocab_size)):
        t = torch.from_numpy(b.tokens.astype("int64")).to(device)
        seg_host = None if b.seg is None else b.seg.astype("int32")
        seg = None if seg_host is None else torch.from_numpy(seg_host).to(device)
        out.append((t, torch.from_numpy(b.lengths).to(device), seg, b.num_targets(), b.real_tokens, seg_host))
        if len(out) == n:
            return out
    return out


class SyntheticSteps:
    """A trainer never started (no sockets; the same model, optimizer and step) and its step on real batches
    already on the device, the block mask built from the host copy of seg as the trainer builds it."""

    def __init__(self, pcfg: PipelineConfig, tcfg: TrainConfig, n_batches: int = 16):
        self.trainer, self.tcfg = Trainer(pcfg, tcfg), tcfg
        self.data = device_batches(pcfg, n_batches, self.trainer.device)
        cuda = self.trainer.device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        """Step i (on batch i mod n): (its loss, on the device; its real tokens)."""
        tok, lengths, seg, n_targets, real, seg_host = self.data[i % len(self.data)]
        inp = build_inputs(tok, lengths, seg, attention=self.tcfg.attention, mask_cache=self.trainer.mask_cache,
                           seg_host=seg_host)  # fmt: skip
        loss, _ = self.trainer.runner.step([inp], n_targets, lr_at(i, self.tcfg))
        return loss, real


def warm_synthetic_steps(args: argparse.Namespace, n_batches: int = 8, **over) -> SyntheticSteps:
    """The synthetic-fed step for the parsed common_args (trainer settings `over` them), run `args.warmup`
    times (compile, warm-up) and synced: the GPU-only probes (bench.kernels, bench.host) start from it."""
    tok, shards = bench_data(Path(args.work))
    step = SyntheticSteps(pipeline_config(shards, tok, args), train_config(args, **over), n_batches)
    for i in range(args.warmup):
        step(i)
    step.sync()
    return step


def measure_synthetic(pcfg: PipelineConfig, tcfg: TrainConfig, warmup: int, n_batches: int = 16) -> Result:
    _reset()
    step = SyntheticSteps(pcfg, tcfg, n_batches)
    flops = step.trainer.model.flops_per_token(pcfg.seq_len)
    tokens, t0 = 0, 0.0
    cuda = step.trainer.device.type == "cuda"
    closed: torch.cuda.Event | None = None
    host = torch.empty((), pin_memory=True) if cuda else None
    for i in range(tcfg.steps):
        if i == warmup:
            step.sync()
            t0 = time.perf_counter()
        loss, real = step(i)
        # as the trainer reads each interval's loss: copied to the host when it closes, waited for once the
        # next step is queued (consumer/runstats.py)
        if closed is not None:
            closed.synchronize()
            closed = None
        if (i + 1) % tcfg.log_every == 0 and host is not None:
            host.copy_(loss.detach(), non_blocking=True)
            closed = torch.cuda.Event()
            closed.record()
        if i >= warmup:
            tokens += real
    step.sync()
    seconds = time.perf_counter() - t0
    tps = tokens / seconds
    res = Result(
        tps,
        1e3 * seconds / (tcfg.steps - warmup),
        0.0,
        mfu(tps, flops),
        _peak(),
    )
    del step
    return res


def common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--compile-mode", default="default", help="as the trainer's --compile-mode")
    p.add_argument("--residual-dtype", default="auto", help="as the trainer's --residual-dtype")
    p.add_argument("--fused-ce", action=argparse.BooleanOptionalAction, default=False,
                   help="liger's fused linear + cross-entropy (default: off, as in the trainer)")  # fmt: skip
    p.add_argument(
        "--lr", type=float, default=6e-4, help="peak learning rate (10 warm-up steps, then cosine)"
    )
    p.add_argument("--warmup", type=int, default=20, help="untimed steps (compile, warm-up)")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--work", default="/tmp/lmpipe-bench", help="tokenizer and shards are built here once")
    p.add_argument("--out", default=None, help="results directory (default: bench/results)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing"
    )


def apply_smoke(args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args = copy.copy(args)
        args.model, args.seq_len, args.batch_size, args.producers = "tiny", 128, 4, 2
        args.precision, args.compile, args.vocab_size, args.warmup, args.steps = "fp32", False, 0, 5, 10
        args.out = smoke_out(args.out)
    return args
