"""Precision: fp32, fp16 without scaling, fp16 static, fp16 dynamic, bf16 on WikiText-2, the one-pass
loss kernel (--fast path loss-kernel) against torch's cross-entropy in fp32 and bf16, and a bf16 residual stream
(--residual-dtype bf16, the default on CUDA) against autocast's fp32 one, which the other modes keep.

    python -m bench.precision                    # GPT-2 124M, T=1024, 300 steps each, eager
    python -m bench.precision --only bf16 fp32   # the modes whose names contain one of these

Same data order, same init, same schedule for every mode; reports the loss averaged over the last 20
steps, time per step, loss-scaler overflows, and plots the loss curves (bench/results/precision-<date>.png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import RESULTS, smoke_out, table, write_result
from bench.trainbench import bench_data, device_batches, pipeline_config
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.inputs import build_inputs
from lmpipe.consumer.step import lr_at
from lmpipe.consumer.trainer import Trainer

WARM = 10  # untimed steps per mode

MODES = [  # name, precision, loss scaling, path loss-kernel, --residual-dtype
    ("fp32", "fp32", "dynamic", False, "fp32"),
    ("fp16, no scaling", "fp16", "none", False, "fp32"),
    ("fp16, static 1024", "fp16", "static:1024", False, "fp32"),
    ("fp16, dynamic", "fp16", "dynamic", False, "fp32"),
    ("bf16", "bf16", "dynamic", False, "fp32"),
    ("fp32, loss kernel", "fp32", "dynamic", True, "fp32"),  # CUDA only: the kernel is Triton
    ("bf16, loss kernel", "bf16", "dynamic", True, "fp32"),
    ("bf16 residual stream", "bf16", "dynamic", False, "bf16"),
    ("bf16 residual stream, loss kernel", "bf16", "dynamic", True, "bf16"),
]


def run(mode: tuple[str, str, str, bool, str], data, pcfg, args) -> dict:
    name, precision, scale, loss_kernel, residual = mode
    tcfg = TrainConfig(
        model=args.model, steps=args.steps, lr=args.lr, warmup=20, precision=precision, loss_scale=scale,
        vocab_size=args.vocab_size, compile=args.compile, seed=1234, fast="auto" if loss_kernel else "auto,-loss-kernel",
        residual_dtype=residual,
    )  # fmt: skip
    trainer = Trainer(pcfg, tcfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    losses = []
    t0 = 0.0
    for i in range(args.steps):
        if i == WARM:  # FlexAttention compiles once per dtype: keep that out of the step time
            sync()
            t0 = time.perf_counter()
        tok, lengths, seg, n_targets, _, _ = data[i % len(data)]
        inp = build_inputs(tok, lengths, seg, mask_cache=trainer.mask_cache)
        loss, _ = trainer.runner.step([inp], n_targets, lr_at(i, tcfg))
        losses.append(loss / n_targets)
    sync()
    seconds = time.perf_counter() - t0
    curve = [float(x) for x in losses]
    overflows = trainer.scaler.counters()[0] if trainer.scaler else 0
    del trainer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    tail = [x for x in curve[-20:] if x == x]  # NaN-free tail
    return {
        "mode": name,
        "loss": sum(tail) / len(tail) if tail else float("nan"),
        "step_ms": 1e3 * seconds / (args.steps - WARM),
        "overflows": overflows,
        "curve": curve,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    p.add_argument(
        "--only", nargs="+", default=None, metavar="TEXT", help="modes whose names contain one of these"
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, few steps: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.model, args.seq_len, args.batch_size, args.steps, args.vocab_size = "tiny", 64, 4, 12, 0
        args.out = smoke_out(args.out)
    cuda = torch.cuda.is_available()
    modes = [m for m in MODES if cuda or (m[1] != "fp16" and not m[3])]  # fp16 and the kernel: CUDA only
    if args.only:
        modes = [m for m in modes if any(t in m[0] for t in args.only)]
    if not modes:
        p.error(
            f"--only {' '.join(args.only)}: no such mode here; the modes: {'; '.join(m[0] for m in MODES)}"
        )
    args.producers = 1
    tok, shards = bench_data(Path(args.work))
    pcfg = pipeline_config(shards, tok, args)
    data = device_batches(pcfg, args.steps, torch.device("cuda" if cuda else "cpu"))
    results = [run(m, data, pcfg, args) for m in modes]
    for r in results:
        print(
            f"{r['mode']}: loss {r['loss']:.4f}, {r['step_ms']:.1f} ms/step, {r['overflows']:.0f} overflows",
            flush=True,
        )
    out = Path(args.out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    (out / f"precision-{stamp}.json").write_text(json.dumps(results))
    png = plot(results, out / f"precision-{stamp}.png")
    rows = [[r["mode"], r["loss"], r["step_ms"], int(r["overflows"])] for r in results]
    body = (
        f"{args.model}, T={args.seq_len}, batch {args.batch_size} rows, packed WikiText-2, {args.steps} steps, "
        f"lr {args.lr} with 20 warmup steps, {'compiled' if args.compile else 'eager (no compile)'}. Loss: mean of the last 20 steps; "
        f"ms/step: steps {WARM + 1} to {args.steps} (the first compile FlexAttention for the mode's dtype).\n\n"
        + table(["precision", "loss", "ms/step", "scaler overflows"], rows)
        + (f"\n\n![loss curves]({png.name})" if png else "")
    )
    print(body)
    write_result("precision", "Precision modes: loss and speed", body, args.out)


def plot(results: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (the curves are in the .json)")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ax.plot(r["curve"], label=r["mode"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
