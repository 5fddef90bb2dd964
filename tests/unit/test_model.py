"""Model semantics: packed rows behave like separate documents; accumulation equals a bigger batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lmpipe.consumer.build import AUTOTUNE_ATTENTION, build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import mix
from lmpipe.consumer.fast.flash import problem as flash_unavailable
from lmpipe.consumer.inputs import MaskCache, build_inputs, cu_seqlens_host, positions, targets_for
from lmpipe.consumer.model import GPT, IGNORE, AttnSpec, preset
from lmpipe.consumer.step import StepRunner, lr_at, make_optimizer
from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError
from tests.helpers import ListStream, masked_packed_batch, tiny_model


def test_packed_attention_equals_each_document_alone():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 97, (n,), generator=g) for n in (7, 19, 1, 12, 25)]
    row = torch.cat(docs)[None]  # 64 tokens, five documents, one row
    seg = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    inp = build_inputs(row, torch.tensor([row.shape[1]]), seg, attention="dense")
    with torch.no_grad():
        packed, _ = model(inp.idx, inp.pos, inp.attn)
        start = 0
        for d in docs:
            alone, _ = model(d[None], torch.arange(len(d))[None], AttnSpec("causal"))
            torch.testing.assert_close(packed[0, start : start + len(d)], alone[0], rtol=1e-5, atol=1e-5)
            start += len(d)


def test_without_the_document_mask_documents_would_leak():
    """The check above is meaningful: plain causal attention over the same row gives different logits."""
    model = tiny_model()
    row = torch.randint(1, 97, (1, 30))
    seg = torch.tensor([[0] * 10 + [1] * 20])
    inp = build_inputs(row, torch.tensor([30]), seg, attention="dense")
    with torch.no_grad():
        masked, _ = model(inp.idx, inp.pos, inp.attn)
        leaky, _ = model(inp.idx, inp.pos, AttnSpec("causal"))
    assert torch.allclose(masked[0, :10], leaky[0, :10], atol=1e-6)  # the first document sees nothing new
    assert not torch.allclose(masked[0, 10:], leaky[0, 10:], atol=1e-3)


def test_positions_and_targets_stay_inside_documents():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]])
    assert positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    tokens = torch.tensor([[10, 11, 12, 20, 21, 30, 0, 0]])
    t = targets_for(tokens, torch.tensor([6]), seg)
    assert t.tolist() == [[11, 12, IGNORE, 21, IGNORE, IGNORE, IGNORE, IGNORE]]
    t = targets_for(tokens, torch.tensor([6]), None)  # a padded row: one document of 6 tokens
    assert t.tolist() == [[11, 12, 20, 21, 30, IGNORE, IGNORE, IGNORE]]


def test_mask_cache_counts_hits_and_misses():
    cache = MaskCache()
    for L in (8, 8, 16, 8):
        build_inputs(
            torch.ones(2, L, dtype=torch.long),
            torch.tensor([L, L]),
            torch.zeros(2, L),
            attention="dense",
            mask_cache=cache,
        )
    assert (cache.hits, cache.misses) == (2, 2)


def _micro_batches(strategy: str):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 97, size=n).tolist() for n in rng.integers(2, 40, size=24)]
    spec = BatchSpec(strategy=strategy, seq_len=32, batch_size=2, bucket_k=5)
    return list(batches(ListStream(docs), spec, epochs=1))[:4]


@pytest.mark.parametrize("strategy", ["pad-batch", "pack"])
def test_accumulation_equals_one_big_batch(strategy):
    micro = _micro_batches(strategy)
    assert len(micro) == 4
    width = max(b.width for b in micro)

    def tensors(b, width):
        tok = np.zeros((b.rows, width), dtype=np.int64)
        tok[:, : b.width] = b.tokens
        seg = None
        if b.seg is not None:
            seg = np.full((b.rows, width), 1000, dtype=np.int64)
            seg[:, : b.width] = b.seg
        return (
            torch.from_numpy(tok),
            torch.from_numpy(b.lengths.copy()),
            None if seg is None else torch.from_numpy(seg),
        )

    cfg = TrainConfig(grad_clip=1.0, fused_adamw=False)
    n_targets = sum(b.num_targets() for b in micro)
    base = tiny_model(seed=3)
    results = []
    for accumulate in (True, False):
        model = copy.deepcopy(base).train()
        # SGD: the update is the gradient itself, so any difference in the accumulated gradient shows
        # (Adam's first step is ~lr * sign(g) and would magnify rounding noise in near-zero gradients)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        runner = StepRunner(model, opt, cfg, None)
        if accumulate:
            inputs = [build_inputs(*tensors(b, b.width), attention="dense") for b in micro]
        else:
            parts = [tensors(b, width) for b in micro]
            cat = [torch.cat([p[i] for p in parts]) if parts[0][i] is not None else None for i in range(3)]
            inputs = [build_inputs(*cat, attention="dense")]
        loss, norm = runner.step(inputs, n_targets, lr=1.0)
        results.append((loss, norm, [p.detach().clone() for p in model.parameters()]))
    (la, na, pa), (lb, nb, pb) = results
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(na, nb, rtol=1e-5, atol=1e-6)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    assert not torch.equal(pa[0], next(base.parameters())), "the step changed the weights"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("grad_clip", [0.05, 1e6])  # clipping, and a limit no gradient reaches
def test_clipping_inside_the_fused_step_equals_clip_grad_norm(grad_clip, device):
    """The fused AdamW divides the gradients by the clip factor as it reads them (no pass of its own):
    the same update, and the same norm reported, as clip_grad_norm_'s multiply followed by the step."""
    dev = torch.device(device)
    micro = [
        build_inputs(*(t.to(dev) for t in masked_packed_batch(48, seed)[:3]), attention="dense")
        for seed in (0, 1)
    ]
    cfg = TrainConfig(grad_clip=grad_clip, fused_adamw=True)
    runs = []
    for inside in (True, False):
        model = tiny_model(seed=5).to(dev).train()
        opt = make_optimizer(model, cfg, dev)
        assert opt.defaults["fused"] is True and opt._step_supports_amp_scaling  # type: ignore[attr-defined]
        runner = StepRunner(model, opt, cfg, None)
        runner.clip_in_step = inside  # path clip-in-step (consumer/fast/clip.py); else clip_grad_norm_'s pass
        norms = [runner.step([m], 100.0, lr=1e-2)[1] for m in micro]  # two steps: Adam's moments matter
        assert not any(hasattr(opt, k) for k in ("grad_scale", "found_inf"))
        runs.append((norms, [p.detach().clone() for p in model.parameters()]))
    (n_in, p_in), (n_ref, p_ref) = runs
    assert n_in[0] > 0.05  # the small limit clips
    torch.testing.assert_close(n_in, n_ref)
    for a, b in zip(p_in, p_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(p_in[0].cpu(), next(tiny_model(seed=5).parameters()))  # the steps changed them


def test_fused_adamw_is_used_when_available():
    opt = make_optimizer(tiny_model(), TrainConfig(fused_adamw=True), torch.device("cpu"))
    assert opt.defaults["fused"] is True


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_presets_build_and_gpt2_has_124m_parameters():
    m = GPT(preset("gpt2-124m", vocab_size=50257))
    assert m.config.vocab_size == 50304
    assert 123e6 < m.num_params(non_embedding=False) < 125e6
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt5")


def test_gradient_checkpointing_gives_the_same_gradients():
    tokens = torch.randint(1, 97, (2, 48))
    seg = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])
    inp = build_inputs(tokens, torch.tensor([48, 40]), seg, attention="dense")
    grads = []
    for ckpt in (False, True):
        m = tiny_model(seed=5).train()
        m.grad_checkpointing = ckpt
        _, loss = m(inp.idx, inp.pos, inp.attn, inp.targets)
        loss.backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_the_document_block_mask_equals_flex_attentions_own_builder(seed):
    """document_block_mask derives each block's state from its first and last document; FlexAttention's
    create_block_mask evaluates the mask at every position. Same dense mask, same full/partial blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lmpipe.consumer.inputs import document_block_mask, document_block_mask_host, document_causal_mask_mod

    g = torch.Generator().manual_seed(seed)
    for trial in range(20):
        B, L = int(torch.randint(1, 4, (1,), generator=g)), 128 * int(torch.randint(1, 6, (1,), generator=g))
        segs = []
        for _ in range(B):
            n = int(torch.randint(0, 12, (1,), generator=g))
            if trial % 2:  # boundaries on block edges: the full blocks
                cuts = torch.randint(0, L // 128 + 1, (n,), generator=g) * 128
            else:
                cuts = torch.randint(0, L, (n,), generator=g)
            segs.append((torch.arange(L)[:, None] >= cuts[None, :]).sum(1).to(torch.int32))
        seg = torch.stack(segs)
        ref = create_block_mask(document_causal_mask_mod(seg), B, None, L, L, device="cpu")
        got = document_block_mask(seg)
        assert torch.equal(ref.to_dense(), got.to_dense()), seg
        assert torch.equal(ref.kv_num_blocks, got.kv_num_blocks)
        assert torch.equal(ref.full_kv_num_blocks, got.full_kv_num_blocks)
        # the host builder (numpy, from the pinned slot's seg) gives every tensor of the device builder,
        # the q-side ones the backward pass reads included
        host = document_block_mask_host(seg.numpy(), seg)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
            a, b = getattr(got, name), getattr(host, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert host.seq_lengths == got.seq_lengths and host.BLOCK_SIZE == got.BLOCK_SIZE


@pytest.mark.parametrize("L", [64, 200, 256])
def test_flex_attention_equals_dense_at_any_row_width(L):
    """Rows narrower than a 128-token block (seq_len 64) or not a multiple of it (200) take
    create_block_mask's path, 256 document_block_mask's: the logits and the masked loss are the dense
    path's either way (forward only: FlexAttention has no backward on CPU; the CUDA test below trains)."""
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=97, block_size=L)).eval()
    tokens, lengths, seg, mask = masked_packed_batch(L, L)
    flex = build_inputs(tokens, lengths, seg, attention="flex", loss_mask=mask)
    dense = build_inputs(tokens, lengths, seg, attention="dense", loss_mask=mask)
    assert flex.attn.kind == "flex" and torch.equal(flex.targets, dense.targets)
    with torch.no_grad():
        got = model(flex.idx, flex.pos, flex.attn)[0], model(flex.idx, flex.pos, flex.attn, flex.targets)[1]
        want = (
            model(dense.idx, dense.pos, dense.attn)[0],
            model(dense.idx, dense.pos, dense.attn, dense.targets)[1],
        )
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("L", [64, 200, 256])
def test_flex_attention_trains_like_dense_at_any_row_width(L):
    """The same on the GPU with the backward pass: equal gradients, masked targets included."""
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=97, block_size=L)).cuda()
    tokens, lengths, seg, mask = (t.cuda() for t in masked_packed_batch(L, L))
    grads = []
    for attention in ("flex", "dense"):
        inp = build_inputs(tokens, lengths, seg, attention=attention, loss_mask=mask)
        model.zero_grad(set_to_none=True)
        model(inp.idx, inp.pos, inp.attn, inp.targets)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("default", {"mode": None}),
        ("reduce-overhead", {"mode": "reduce-overhead"}),
        ("autotune-attention", {"options": AUTOTUNE_ATTENTION}),
    ],
)
def test_compile_modes_reach_torch_compile(monkeypatch, mode, expected):
    """--compile-mode autotune-attention is max-autotune's options with the matmuls left to cuBLAS."""
    seen: dict = {}

    def compile_spy(model, **kw):
        seen.update(kw)
        return model

    monkeypatch.setattr(torch, "compile", compile_spy)
    tcfg = TrainConfig(model="tiny", compile=True, compile_mode=mode, metrics_port=None)
    build(PipelineConfig(seq_len=64), tcfg, 512, torch.device("cpu"), "fp32", None, Dist())
    assert {k: v for k, v in seen.items() if k != "dynamic"} == expected
    assert seen["dynamic"] is False
    if mode == "autotune-attention":
        assert AUTOTUNE_ATTENTION["max_autotune_gemm_backends"] == "ATEN"
        assert (
            torch._inductor.list_mode_options("max-autotune-no-cudagraphs").items()
            <= {k: v for k, v in AUTOTUNE_ATTENTION.items() if k != "max_autotune_gemm_backends"}.items()
        )


def test_flash_document_offsets_mark_every_piece_and_pad_to_a_bucket():
    """--attention flash's cu_seqlens: a piece starts wherever seg changes and at every row start, and the
    list is padded with B * L (empty documents) to a power of two of at least 64, so that a compiled model
    sees one shape for almost every batch."""
    tokens, lengths, seg, _ = masked_packed_batch(200, 3)
    cu = cu_seqlens_host(seg.numpy())
    B, L = seg.shape
    assert len(cu) == 64 and cu.dtype == np.int32
    ends = np.flatnonzero(cu == B * L)
    real = cu[: ends[0] + 1]  # the starts, then the end
    assert (np.diff(real) > 0).all() and real[0] == 0
    piece = np.zeros(B * L, dtype=int)  # which piece each flattened token is in, by the offsets
    piece[real[1:-1]] = 1
    piece = piece.cumsum().reshape(B, L)
    same = piece[:, :, None] == piece[:, None, :]
    want = seg.numpy()[:, :, None] == seg.numpy()[:, None, :]
    assert (same == want).all()  # within a row: the same piece exactly where the same document
    assert len(np.unique(piece[0])) + len(np.unique(piece[1])) == len(real) - 1  # rows share no piece
    many = np.arange(2 * 256).reshape(2, 256)  # every token its own document: 512 pieces
    assert len(cu_seqlens_host(many)) == 1024


def test_attention_flash_off_a_hopper_gpu_is_one_clear_error():
    tcfg = TrainConfig(model="tiny", attention="flash", metrics_port=None)
    with pytest.raises(ValueError, match="--attention flash needs a CUDA GPU"):
        build(PipelineConfig(seq_len=64), tcfg, 512, torch.device("cpu"), "fp32", None, Dist())


def _flash_or_skip():
    if not torch.cuda.is_available() or (why := flash_unavailable(torch.device("cuda"))):
        pytest.skip(why if torch.cuda.is_available() else "no CUDA")


@pytest.mark.cuda
@pytest.mark.parametrize("L", [200, 256])
def test_flash_attention_trains_like_dense(L):
    """--attention flash (FlashAttention-4 varlen, consumer/fast/flash.py) gives the dense mask's loss and
    gradients in bf16, eager and compiled."""
    _flash_or_skip()
    from lmpipe.consumer.fast.flash import FlashAttention

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=97, block_size=L)).cuda()
    for block in model.transformer.h:
        mix(block.attn, FlashAttention)  # as build() does for --attention flash
    tokens, lengths, seg, mask = (t.cuda() for t in masked_packed_batch(L, L))
    losses, grads = [], []
    for attention, run in (
        ("dense", model),
        ("flash", model),
        ("flash", torch.compile(model, dynamic=False)),
    ):
        inp = build_inputs(
            tokens, lengths, seg, attention=attention, loss_mask=mask, seg_host=seg.cpu().numpy()
        )
        assert inp.attn.kind == ("varlen" if attention == "flash" else "dense")
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(inp.idx, inp.pos, inp.attn, inp.targets)[1]
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    for loss, g in zip(losses[1:], grads[1:]):
        assert abs(loss - losses[0]) < 1e-2 * abs(losses[0])
        assert (g - grads[0]).norm() < 2e-2 * grads[0].norm()


def _block_dtypes(residual: str, precision: str, autocast_dtype, inp) -> tuple[set, float, torch.Tensor]:
    """The dtypes the blocks read and write, the loss and the head's gradient, under `precision` on CPU."""
    tcfg = TrainConfig(model="tiny", precision=precision, residual_dtype=residual, metrics_port=None)
    torch.manual_seed(5)
    model = build(
        PipelineConfig(seq_len=48), tcfg, 97, torch.device("cpu"), precision, autocast_dtype, Dist()
    ).model
    seen: list[torch.dtype] = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda _m, args, out: seen.extend([args[0].dtype, out.dtype]))
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        _, loss = model(inp.idx, inp.pos, inp.attn, inp.targets)
    loss.backward()
    return set(seen), loss.item(), model.lm_head.weight.grad.float()


def test_the_residual_stream_is_bf16_where_the_matmuls_are_and_trains_like_fp32():
    """--residual-dtype auto (the default) and bf16: the blocks read and write bf16 under bf16 autocast;
    fp32 keeps autocast's fp32 stream, as does auto where the matmuls run in fp32. The loss and gradients
    stay within bf16's rounding of the fp32 stream's."""
    tokens = torch.randint(1, 97, (2, 48))
    seg = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])
    inp = build_inputs(tokens, torch.tensor([48, 40]), seg, attention="dense")
    seen, ref, g_ref = _block_dtypes("fp32", "bf16", torch.bfloat16, inp)
    assert seen == {torch.float32}
    for residual in ("auto", "bf16"):
        seen, got, g = _block_dtypes(residual, "bf16", torch.bfloat16, inp)
        assert seen == {torch.bfloat16}, residual
        assert got == pytest.approx(ref, rel=1e-2)
        assert torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0) > 0.99
    assert TrainConfig().residual_dtype == "auto"
    assert _block_dtypes("auto", "fp32", None, inp)[0] == {torch.float32}


def test_bf16_residual_stream_needs_bf16_matmuls():
    for precision in ("fp32", "fp16"):
        with pytest.raises(
            SettingsError, match=f"--residual-dtype bf16 needs --precision bf16 or fp8, not {precision}"
        ):
            TrainConfig(precision=precision, residual_dtype="bf16")
    with pytest.raises(SettingsError, match="not auto, which is fp32 on --device cpu"):
        TrainConfig(device="cpu", residual_dtype="bf16")
    assert TrainConfig(precision="fp8", residual_dtype="bf16").residual_dtype == "bf16"
    assert TrainConfig(device="cpu", precision="bf16", residual_dtype="bf16").residual_dtype == "bf16"
