"""Document-masked attention kernels side by side, on the packed batches the trainer gets (issue: MFU).

    python -m bench.attention                    # GPT-2 124M's shape: 32 x 1024 tokens, 12 heads of 64, bf16

FlexAttention is a sixth of a GPT-2 124M step on an H100 (bench/results/kernels-*.md). Each variant runs
forward + backward on the same WikiText-2 packed batches (documents of ~210 tokens, so most of a row's
causal triangle is masked), is checked against the trainer's kernel (outputs and gradients), and timed:
- flex, 128-blocks: the trainer's FlexAttention with its block mask (consumer/inputs.py);
- flex, 128-blocks, max-autotune: the same compiled with mode max-autotune-no-cudagraphs (tuned tiles);
- flex, 64-blocks: a block mask of 64 x 64 blocks (less of each block masked out, more blocks);
- varlen: torch.nn.attention.varlen (FlashAttention-2 inside torch) over the rows' document pieces, where
  torch has it;
- FA4 varlen: FlashAttention-4 (flash-attn-4, CuTe DSL) over the same pieces, called directly (exact
  cu_seqlens and longest piece) and as the trainer calls it (`--attention flash`, consumer/fast/flash.py: padded
  cu_seqlens, the row length as the longest piece), where flash_attn.cute is installed;
- flex, FLASH backend: the trainer's FlexAttention with kernel_options BACKEND=FLASH (FlashAttention-4's
  kernels behind FlexAttention's block mask), where torch and flash_attn.cute allow it;
- cuDNN varlen: cuDNN's fused attention over the same pieces (torch.ops.aten._cudnn_attention_forward with
  cumulative offsets, the path torch.nn.attention.varlen keeps switched off), where this torch has it;
- SDPA causal: plain causal attention ignoring documents, the work a row would cost without the mask, with
  torch's default kernel and with cuDNN's.
Writes bench/results/attention-<date>.md.
"""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

from bench.common import table, write_result
from bench.trainbench import bench_data, device_batches, pipeline_config
from lmpipe.consumer.fast.flash import varlen_attention
from lmpipe.consumer.inputs import cu_seqlens_host, document_block_mask_host

# FlexAttention tile sizes to try (kernel_options; fwd_/bwd_ name one direction's). "bwd 32/64/64/32":
# what max-autotune picked for the backward on an H100 (bench/results/attention-*.md); "gym": the options
# PyTorch's attention-gym benchmark uses for document masks.
KERNEL_OPTIONS: dict[str, dict] = {
    "bwd 32/64/64/32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "fwd 64x64 + bwd 32/64/64/32": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 32,
                                    "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                                    "bwd_num_warps": 4, "bwd_num_stages": 3},
    # Hopper's tensor memory accelerator for the loads (USE_TMA; torch turns it off where strides forbid it)
    "fwd 64x64 + bwd 32/64/64/32, TMA": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 32,
                                         "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                                         "bwd_num_warps": 4, "bwd_num_stages": 3, "USE_TMA": True},
    "TMA, tiles as the heuristics pick": {"USE_TMA": True},
    "gym": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 32, "fwd_num_warps": 8, "fwd_num_stages": 4,
            "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64},
}  # fmt: skip


def cu_seqlens(seg_host: np.ndarray) -> tuple[np.ndarray, int]:
    """Start of every document piece in the flattened [B * L] tokens, and B * L at the end (the trainer's
    offsets without their padding); the longest piece."""
    padded = cu_seqlens_host(seg_host)
    cu = padded[: int(np.argmax(padded == seg_host.size)) + 1]
    return cu, int(np.diff(cu).max())


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = (
        {"is_causal": True}
        if "is_causal" in inspect.signature(varlen_attn).parameters
        else {"window_size": (-1, 0)}
    )

    def run(q, k, v, cu, max_len):  # q, k, v: [B, L, H, D] -> [B, L, H, D]
        B, L, H, D = q.shape
        flat = [t.reshape(B * L, H, D) for t in (q, k, v)]
        return varlen_attn(*flat, cu, cu, max_len, max_len, **causal).view(B, L, H, D)

    return run


def fa4_fn():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None

    def run(q, k, v, cu, max_len):  # q, k, v: [B, L, H, D] -> [B, L, H, D]
        B, L, H, D = q.shape
        flat = [t.reshape(B * L, H, D) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                     max_seqlen_k=max_len, causal=True)  # fmt: skip
        return (out[0] if isinstance(out, tuple) else out).view(B, L, H, D)

    return run


def cudnn_varlen_fn():
    """cuDNN's fused attention over document pieces; q, k, v [B, L, H, D] -> [B, L, H, D]."""
    if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        return None

    class CudnnVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu, max_len):
            scale = q.shape[-1] ** -0.5
            out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
            )
            ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
            ctx.max_len, ctx.scale = max_len, scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                dout.contiguous(), q, k, v, out, lse, seed, offset, q.new_empty(0), cu, cu,
                ctx.max_len, ctx.max_len, 0.0, True, scale=ctx.scale,
            )  # fmt: skip
            return dq, dk, dv, None, None

    def run(q, k, v, cu, max_len):
        B, L, H, D = q.shape
        flat = [t.reshape(B * L, H, D) for t in (q, k, v)]
        return CudnnVarlen.apply(*flat, cu, max_len).view(B, L, H, D)

    return run


# FlashAttention-4's SM90 tiles to try on short documents (--fa4-tiles): its defaults for head dim 64 are
# FA3's (forward 192 x 128, backward 128 x 128), tuned on long sequences. (m, n) of the forward, and of the
# backward with the rest of FA3's configuration for that size.
FA4_FWD_TILES = [None, (128, 128), (128, 64), (64, 64), (64, 128)]
FA4_BWD_TILES = [None, (64, 128), (64, 64), (128, 64)]


def fa4_tile_rows(q, k, v, grad_out, cu, max_len, iters):
    """ms per call, forward alone and forward + backward, for each FA4 tile choice (SM90)."""
    from flash_attn.cute import interface as fa

    default_bwd = fa._tile_size_bwd_sm90
    rows = []
    for fwd_tile in FA4_FWD_TILES:
        for bwd_tile in FA4_BWD_TILES if fwd_tile is None else [None]:
            name = f"FA4 varlen, fwd {fwd_tile or 'default'}, bwd {bwd_tile or 'default'}"
            try:
                if bwd_tile is not None:
                    m, n = bwd_tile

                    def cfg(*a, m=m, n=n, **kw):
                        base = default_bwd(*a, **kw)
                        return fa.BwdConfig(
                            m_block_size=m, n_block_size=n, num_stages_Q=2, num_stages_dO=2,
                            num_stages_PdS=2, SdP_swapAB=base.SdP_swapAB, dKV_swapAB=False,
                            dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2 if n >= 128 else 1,
                            AtomLayoutMdQ=1, dQ_single_wg=m == 64,
                        )  # fmt: skip

                    fa._tile_size_bwd_sm90 = cfg
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                          causal=True, return_lse=True, tile_mn=fwd_tile)  # fmt: skip

                def fwd(kw=kw):
                    return fa._flash_attn_fwd(q, k, v, **kw)[:2]

                def both(kw=kw):
                    out, lse = fwd()
                    return fa._flash_attn_bwd(
                        q, k, v, out, grad_out, lse, None, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=max_len, max_seqlen_k=max_len,
                    )  # fmt: skip

                times = []
                for f in (fwd, both):
                    for _ in range(3):
                        f()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        f()
                    torch.cuda.synchronize()
                    times.append(1e3 * (time.perf_counter() - t0) / iters)
                rows.append([name, f"{times[0]:.3f}", f"{times[1] - times[0]:.3f}", f"{times[1]:.3f}"])
            except Exception as exc:
                rows.append([name, "failed", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"])
            finally:
                fa._tile_size_bwd_sm90 = default_bwd
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=12, help="calls per training step (one per layer)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--fa4-tiles", action="store_true", help="only FlashAttention-4's tile choices, timed")
    p.add_argument(
        "--only", nargs="+", default=None, help="only the kernels whose names contain one of these"
    )
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA GPU")
    dev = torch.device("cuda")
    tok, shards = bench_data(Path(a.work))
    args = argparse.Namespace(seq_len=a.seq_len, batch_size=a.batch_size, producers=1)
    batches = device_batches(pipeline_config(shards, tok, args), 4, dev)
    B, L, H, D = a.batch_size, a.seq_len, a.heads, a.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(B, L, 3 * H * D, device=dev, dtype=torch.bfloat16, generator=g)
    grad_out = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, generator=g)

    def qkv_views(x):  # as the model makes them: one projection, split, heads second
        return [t.view(B, L, H, D).transpose(1, 2) for t in x.split(H * D, dim=2)]

    if a.fa4_tiles:
        cu_np, m = cu_seqlens(batches[0][5])
        fq, fk, fv = (t.reshape(B * L, H, D).contiguous() for t in qkv.split(H * D, dim=2))
        rows = fa4_tile_rows(fq, fk, fv, grad_out.transpose(1, 2).reshape(B * L, H, D).contiguous(),
                             torch.from_numpy(cu_np).to(dev), m, a.iters)  # fmt: skip
        body = (
            f"B={B}, T={L}, {H} heads of {D}, bf16, one WikiText-2 packed batch, {a.iters} timed calls.\n\n"
        )
        body += table(["FA4 tiles", "forward ms", "backward ms", "forward + backward ms"], rows)
        print(body)
        write_result("attention-fa4-tiles", "FlashAttention-4's SM90 tiles on short documents", body, a.out)
        return
    flex = torch.compile(flex_attention, dynamic=False)
    flex_tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    vl = varlen_fn()
    fa4 = fa4_fn()
    cudnn = cudnn_varlen_fn()

    def make(name: str, block: int = 128, tuned: bool = False, options: dict | None = None):
        """(prepare(batch) -> state, call(q, k, v, state) -> out [B, H, L, D])"""
        if name.startswith("flex"):
            fn = flex_tuned if tuned else flex
            return (
                lambda bt: document_block_mask_host(bt[5], bt[2], block),
                lambda q, k, v, bm: fn(q, k, v, block_mask=bm, kernel_options=options),
            )
        if name.startswith("FA4 varlen, as the trainer"):

            def prep_padded(bt):
                return torch.from_numpy(cu_seqlens_host(bt[5])).to(dev)

            def call_op(q, k, v, cu):
                return varlen_attention(*(t.transpose(1, 2) for t in (q, k, v)), cu).transpose(1, 2)

            return prep_padded, call_op
        if name.startswith(("varlen", "FA4", "cuDNN varlen")):
            fn = vl if name.startswith("varlen") else cudnn if name.startswith("cuDNN") else fa4
            assert fn is not None

            def prep(bt):
                cu, m = cu_seqlens(bt[5])
                return torch.from_numpy(cu).to(dev), m

            def call(q, k, v, st, fn=fn):
                out = fn(*(t.transpose(1, 2) for t in (q, k, v)), *st)
                return out.transpose(1, 2)

            return prep, call
        if "cuDNN" in name:

            def sdpa_cudnn(q, k, v, _):
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    return sdpa(q, k, v, is_causal=True)

            return (lambda bt: None), sdpa_cudnn
        return (lambda bt: None), (lambda q, k, v, _: sdpa(q, k, v, is_causal=True))

    variants: list[tuple[str, dict]] = [
        ("flex, 128-blocks (the trainer's)", {}),
        ("flex, 128-blocks, max-autotune", {"tuned": True}),
        *[(f"flex, 128-blocks, {k}", {"options": o}) for k, o in KERNEL_OPTIONS.items()],
        ("flex, 64-blocks, max-autotune", {"block": 64, "tuned": True}),
        *[(f"flex, 64-blocks, {k}", {"block": 64, "options": o}) for k, o in KERNEL_OPTIONS.items()
          if "fwd_BLOCK_M" in o and all(v <= 64 for n, v in o.items() if "BLOCK" in n)],
    ]  # fmt: skip
    variants += [("varlen (FlashAttention-2 in torch)", {})] if vl is not None else []
    if fa4 is not None:
        variants += [
            ("FA4 varlen (flash_attn.cute, exact cu_seqlens)", {}),
            ("FA4 varlen, as the trainer calls it (--attention flash)", {}),
            ("flex, 128-blocks, FLASH backend", {"options": {"BACKEND": "FLASH"}}),
        ]
    variants += (
        [("cuDNN varlen (aten._cudnn_attention_forward, exact offsets)", {})] if cudnn is not None else []
    )
    variants += [
        ("SDPA causal, no document mask (reference work)", {}),
        ("SDPA causal, cuDNN kernel, no document mask (reference work)", {}),
    ]
    if a.only:  # the first row stays: it is the reference every other row is checked and timed against
        variants = variants[:1] + [v for v in variants[1:] if any(o in v[0] for o in a.only)]
    ref: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = []
    for name, kw in variants:
        try:
            prep, call = make(name, **kw)
            states = [prep(bt) for bt in batches]

            def once(i: int, keep: bool = False, call=call, states=states):
                x = qkv.detach().requires_grad_()
                out = call(*qkv_views(x), states[i % len(states)])
                out.backward(grad_out)
                return (out.detach(), x.grad) if keep else None

            got = once(0, keep=True)
            for i in range(3):  # compile, autotune, warm up
                once(i)
            if not ref:
                ref.append(got)
            err = max((got[0] - ref[0][0]).abs().max().item(), (got[1] - ref[0][1]).abs().max().item())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(a.iters):
                once(i)
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0) / a.iters
            rows.append([name, f"{ms:.3f}", f"{ms * a.layers:.2f}", f"{err:.3g}"])
        except Exception as exc:  # a variant this torch cannot run is reported, not fatal
            rows.append([name, "failed", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"])
        print(rows[-1], flush=True)
    base = float(rows[0][1]) if rows[0][1] != "failed" else float("nan")
    for r in rows:
        r.insert(3, f"{base / float(r[1]):.2f}" if r[1] != "failed" else "")
    docs = np.mean([len(cu_seqlens(bt[5])[0]) - 1 for bt in batches]) / B
    body = (
        f"B={B}, T={L}, {H} heads of {D}, bf16, forward + backward per call, {a.iters} timed calls after 4 "
        f"untimed; WikiText-2 packed batches ({docs:.1f} document pieces a row). torch {torch.__version__}. "
        "max |diff|: against the first row, over the output and the gradient of the fused q/k/v "
        "projection (SDPA causal differs by design: it ignores documents).\n\n"
        + table(
            ["kernel", "ms per call", f"ms per step ({a.layers} layers)", "speed vs flex", "max |diff|"], rows
        )
    )
    print(body)
    write_result("attention", "Document-masked attention kernels side by side", body, a.out)


if __name__ == "__main__":
    main()
