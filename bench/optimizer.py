"""Probe: the optimizer's part of a step (grad norm, clip, AdamW) on GPT-2 124M's parameters, side by side.

The trainer's step ends with the gradients' norm, clip_grad_norm_'s clip and AdamW. This times two ways of
running them on the model's own parameters (random gradients, so every step clips): clip_grad_norm_'s
multiply then torch's fused AdamW, the clip inside torch's fused AdamW's grad_scale, and the clip inside the
Triton AdamW's grad_scale (consumer/fast/adamw.py; the trainer's on CUDA). The floor
is one read of the gradients for the norm, then AdamW's reads of weights, gradients and both moments and its
writes of weights and moments, at the card's memory bandwidth. (A third way, the three compiled as one
torch.compile'd function over torch's functional AdamW, was slower: bench/results/optimizer-h200-2026-11-27.md.)

    python -m bench.optimizer [--model gpt2-124m] [--iters 50]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.common import cuda_ms, table, write_result
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.fast import adamw
from lmpipe.consumer.model import GPT, preset
from lmpipe.consumer.step import make_optimizer


def triton_adamw(model: torch.nn.Module, cfg: TrainConfig, dev: torch.device) -> adamw.AdamW:
    """consumer/fast/adamw.py's AdamW over make_optimizer's groups, as path adamw builds it."""
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"]}
        for g in make_optimizer(model, cfg, dev).param_groups
    ]
    return adamw.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles", default="", help="the Triton AdamW's other settings: 'CHUNK,BLOCK,WARPS ...'")
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = TrainConfig(grad_clip=1.0, fused_adamw=True)
    model = GPT(preset(a.model, vocab_size=50257)).to(dev)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    torch.manual_seed(0)
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    torch_opt = torch.optim.AdamW(make_optimizer(model, cfg, dev).param_groups, fused=True)
    triton_opt = triton_adamw(model, cfg, dev)  # consumer/fast/adamw.py's, as the trainer's on CUDA

    def clip_then_step() -> None:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
        torch_opt.step()

    def clip_in_grad_scale(opt) -> Callable[[], None]:
        def step() -> None:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            opt.grad_scale = ((norm + 1e-6) / cfg.grad_clip).clamp(min=1.0)  # type: ignore[attr-defined]
            opt.step()
            del opt.grad_scale  # type: ignore[attr-defined]

        return step

    ways = [
        ("clip_grad_norm_'s multiply, then torch's fused AdamW", clip_then_step),
        ("the clip in torch's fused AdamW's grad_scale", clip_in_grad_scale(torch_opt)),
        (f"the clip in the Triton AdamW's grad_scale (CHUNK {adamw.CHUNK}, BLOCK {adamw.BLOCK}, "
         f"{adamw.WARPS} warps: the trainer's)", clip_in_grad_scale(triton_opt)),
    ]  # fmt: skip
    shipped = (adamw.CHUNK, adamw.BLOCK, adamw.WARPS)

    def with_tiles(tiles: tuple[int, int, int]) -> Callable[[], None]:
        step = clip_in_grad_scale(triton_adamw(model, cfg, dev))  # its own table, of this CHUNK

        def run() -> None:
            adamw.CHUNK, adamw.BLOCK, adamw.WARPS = tiles
            step()
            adamw.CHUNK, adamw.BLOCK, adamw.WARPS = shipped

        return run

    for tiles in a.tiles.split():  # the Triton AdamW's other launch settings
        chunk, block, warps = map(int, tiles.split(","))
        ways.append(
            (
                f"the Triton AdamW, CHUNK {chunk}, BLOCK {block}, {warps} warps",
                with_tiles((chunk, block, warps)),
            )
        )
    bandwidth = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
    floor = (
        4 * n * (1 + 4 + 3) / bandwidth * 1e3
    )  # fp32: norm reads g; AdamW reads p, g, m, v, writes p, m, v
    rows = []
    for _ in range(2):  # twice, interleaved: the spread between rounds shows
        for name, fn in ways:
            ms = cuda_ms(fn, a.iters, warmup=5)
            rows.append([name, ms, floor / ms])
    body = (
        f"{a.model}: {n:,} parameters in {len(params)} tensors, fp32, AdamW with weight decay on the matrices, "
        f"gradients clipped to norm {cfg.grad_clip}; {a.iters} timed calls each, two interleaved rounds. "
        f"Floor: {floor:.3f} ms (a read of the gradients, then AdamW's 4 reads and 3 writes, at "
        f"{bandwidth / 1e12:.2f} TB/s).\n\n" + table(["way", "ms per step", "floor / ms"], rows)
    )
    print(body)
    write_result("optimizer", "The optimizer's part of a step: grad norm, clip, AdamW", body, a.out)


if __name__ == "__main__":
    main()
