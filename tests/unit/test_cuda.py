"""GPU behaviour: flash for unpacked rows, exact FlexAttention for packed rows, copy-stream slots, fused
loss, compile with bounded shapes, and the trainer end to end on CUDA. Skipped without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmpipe.consumer.fast import mix
from lmpipe.consumer.fast.liger import LigerLoss, fused_linear_cross_entropy
from lmpipe.consumer.inputs import build_inputs
from lmpipe.consumer.model import GPT, AttnSpec, preset

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


def model(seed=0, vocab=512, block=256) -> GPT:
    torch.manual_seed(seed)
    return GPT(preset("tiny", vocab_size=vocab, block_size=block)).to(DEV).eval()


def test_flash_attention_is_chosen_for_unpacked_rows():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = model()
    x = torch.randint(0, 512, (4, 256), device=DEV)
    pos = torch.arange(256, device=DEV).expand(4, 256)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot run these inputs
            flash, _ = m(x, pos, AttnSpec("causal"))
        with sdpa_kernel([SDPBackend.MATH]):
            math, _ = m(x, pos, AttnSpec("causal"))
    torch.testing.assert_close(flash.float(), math.float(), rtol=2e-2, atol=2e-2)


def _packed(seed: int, L: int = 256, B: int = 3):
    g = torch.Generator().manual_seed(seed)
    rows, segs, docs = [], [], []
    for _ in range(B):
        lens, total = [], 0
        while total < L:
            n = min(int(torch.randint(1, 90, (1,), generator=g)), L - total)
            lens.append(n)
            total += n
        toks = [torch.randint(1, 512, (n,), generator=g) for n in lens]
        rows.append(torch.cat(toks))
        segs.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]))
        docs.append(toks)
    return torch.stack(rows).to(DEV), torch.stack(segs).to(DEV), docs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_packed_attention_equals_each_document_alone(dtype):
    m = model()
    tokens, seg, docs = _packed(1)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1], device=DEV)
    inp = build_inputs(tokens, lengths, seg, attention="flex")
    assert inp.attn.kind == "flex"
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        packed, _ = m(inp.idx, inp.pos, inp.attn)
        dense = build_inputs(tokens, lengths, seg, attention="dense")
        packed_dense, _ = m(dense.idx, dense.pos, dense.attn)
        torch.testing.assert_close(packed.float(), packed_dense.float(), **tol)
        for b, row_docs in enumerate(docs):
            start = 0
            for d in row_docs:
                d = d.to(DEV)
                alone, _ = m(d[None], torch.arange(len(d), device=DEV)[None], AttnSpec("causal"))
                torch.testing.assert_close(packed[b, start : start + len(d)].float(), alone[0].float(), **tol)
                start += len(d)


def test_flex_has_no_cross_document_leakage():
    m = model()
    tokens, seg, docs = _packed(2, B=1)
    lengths = torch.tensor([tokens.shape[1]], device=DEV)
    first = len(docs[0][0])
    other = tokens.clone()
    other[0, :first] = torch.randint(1, 512, (first,), device=DEV)  # rewrite the first document only
    with torch.no_grad():
        a, _ = m(*(lambda i: (i.idx, i.pos, i.attn))(build_inputs(tokens, lengths, seg, attention="flex")))
        b, _ = m(*(lambda i: (i.idx, i.pos, i.attn))(build_inputs(other, lengths, seg, attention="flex")))
    assert not torch.allclose(a[0, :first], b[0, :first])
    torch.testing.assert_close(
        a[0, first:], b[0, first:], rtol=0, atol=0
    )  # later documents saw nothing of it


def test_fused_cross_entropy_matches_the_plain_loss():
    if fused_linear_cross_entropy() is None:
        pytest.skip("liger-kernel not installed")
    plain, fused = model(vocab=4096), model(vocab=4096)
    mix(fused, LigerLoss)
    fused.fused_ce = fused_linear_cross_entropy()
    x = torch.randint(0, 4096, (4, 256), device=DEV)
    pos = torch.arange(256, device=DEV).expand(4, 256)
    t = torch.randint(0, 4096, (4, 256), device=DEV)
    t[:, -5:] = -100
    losses = []
    for m in (plain, fused):
        m.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = m(x, pos, AttnSpec("causal"), t)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=0)
    a, b = plain.lm_head.weight.grad, fused.lm_head.weight.grad
    rel = (a - b).norm() / b.norm()
    assert rel < 2e-2, f"relative error of the gradient {rel:.2e} (bf16 operands: 1e-3 to 1e-2 expected)"


def _head_grads(m: GPT, compiled: bool, dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """Loss and two gradients (the tied head/embedding, and a first-block weight that only the hidden
    state's gradient reaches) for one batch: a vocabulary that is not a multiple of the kernel's block,
    ignored targets, a row all ignored, and an upstream gradient other than 1."""
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randint(0, 5000, (4, 256), device=DEV, generator=g)
    t = torch.randint(0, 5000, (4, 256), device=DEV, generator=g)
    t[:, -5:] = -100
    t[2] = -100
    pos = torch.arange(256, device=DEV).expand(4, 256)
    m.train()
    if compiled:
        torch._dynamo.reset()  # each model compiles afresh, not as a recompile that may hit dynamo's limit
    step = torch.compile(m) if compiled else m
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        _, loss = step(x, pos, AttnSpec("causal"), t)
    (loss * 0.37).backward()  # the trainer scales the summed loss by 1 / targets
    return loss.detach().float(), m.lm_head.weight.grad, m.transformer.h[0].mlp.c_fc.weight.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_loss_kernel_equals_torchs_cross_entropy_in_fp32(compiled, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 means fp32 here
    torchs = _head_grads(model(vocab=5000), compiled, None)
    from lmpipe.consumer.fast.loss import KernelLoss

    kern = model(vocab=5000)
    mix(kern, KernelLoss)
    ours = _head_grads(kern, compiled, None)
    for a, b in zip(ours, torchs):
        assert _rel(a, b) < 1e-4, f"relative difference {_rel(a, b):.2e} from torch's in fp32"


@pytest.mark.parametrize("tuned", [False, True], ids=["torch-gemm", "tuned-gemm"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_loss_kernel_in_bf16_is_as_close_to_fp32_as_torchs(compiled, tuned, monkeypatch):
    """Both paths round to bf16; the kernel's error against the fp32 result may be no larger than
    torch's own. A bias (a wrong scale, a lost term) shows up here long before a loss curve shows it.
    tuned-gemm: the head's forward GEMM through nvmath (consumer/fast/cublaslt.py) as well."""
    from lmpipe.consumer.fast import cublaslt
    from lmpipe.consumer.fast import loss as L

    if tuned and cublaslt.nvmath_missing():
        pytest.skip(cublaslt.nvmath_missing())
    from lmpipe.consumer.fast.head_gemm import TunedHead

    monkeypatch.setattr(cublaslt, "_plans", {})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    truth = _head_grads(model(vocab=5000), compiled, None)
    torchs = _head_grads(model(vocab=5000), compiled, torch.bfloat16)
    kern = model(vocab=5000)
    mix(kern, TunedHead if tuned else L.KernelLoss)
    ours = _head_grads(kern, compiled, torch.bfloat16)
    for name, a, b, ref in zip(("loss", "head grad", "block-0 grad"), ours, torchs, truth):
        err, base = _rel(a, ref), _rel(b, ref)
        print(f"{name}: kernel {err:.2e}, torch {base:.2e} from fp32")
        assert err <= 1.5 * base + 1e-5, f"{name}: the kernel is {err:.2e} from fp32, torch's bf16 {base:.2e}"
    assert bool(cublaslt._plans) == tuned  # the head's GEMM went where it was sent


@pytest.mark.parametrize("tuned", [False, True], ids=["torch-gemm", "tuned-gemm"])
def test_the_heads_weight_gradient_comes_in_the_weights_layout(tuned, monkeypatch):
    """A gradient in another layout than its weight's is copied into it by autograd: a strided copy of the
    whole [vocab, C] matrix every step. Both GEMM paths hand dW over row-major, as the weight is."""
    from lmpipe.consumer.fast import cublaslt
    from lmpipe.consumer.fast import loss as L

    if tuned and cublaslt.nvmath_missing():
        pytest.skip(cublaslt.nvmath_missing())
    monkeypatch.setattr(cublaslt, "_plans", {})
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(512, 64, device=DEV, generator=g, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, 64, device=DEV, generator=g, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (512,), device=DEV, generator=g)
    seen = []
    w.register_hook(lambda grad: seen.append(grad))
    L.head_loss(h, w, targets, -1, tuned).backward()
    assert seen[0].stride() == w.stride()
    want = torch.nn.functional.cross_entropy(h.float() @ w.float().t(), targets, reduction="sum")
    (dw,) = torch.autograd.grad(want, w)
    assert _rel(seen[0].float(), dw) < 2e-2
    assert bool(cublaslt._plans) == tuned


def test_head_backward_scale_is_the_fp32_product_rounded_once():
    from lmpipe.consumer.fast.loss import _times

    g = torch.Generator(device=DEV).manual_seed(0)
    for n in (1, 4095, 4097, 50304 * 8):
        t = torch.randn(n, device=DEV, generator=g).bfloat16()
        for scale in (1.0, 0.37, 1 / 32768, 3e5):
            s = torch.tensor(scale, device=DEV)
            assert torch.equal(_times(t, s), (t.float() * s).bfloat16()), (n, scale)


@pytest.mark.parametrize("attention", ["flex", "flash"])
def test_building_a_batchs_inputs_does_not_wait_for_the_gpu(attention):
    """The block mask (and flash's offsets) are made on the host and copied while the GPU still runs the
    last step's kernels: no host sync (an .item(), a .cpu(), a blocking copy) may creep into the build.
    The copy is from pageable memory; for these few kilobytes CUDA stages it without waiting for the stream
    (checked on an H100, bench/results/host-h100-2026-11-27.md)."""
    B, L = 4, 1024
    seg_host = np.repeat(np.arange(8, dtype=np.int32), L // 8)[None].repeat(B, 0)
    tokens = torch.randint(0, 100, (B, L), device=DEV, dtype=torch.int32)
    lengths = torch.full((B,), L, device=DEV, dtype=torch.int32)
    seg = torch.from_numpy(seg_host).to(DEV)
    build_inputs(tokens, lengths, seg, attention=attention, seg_host=seg_host)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a second or so of GPU work queued ahead of the copy
    slept = torch.cuda.Event()
    slept.record()  # done when the sleep is: the stream alone would also be busy with the build's own kernels
    inp = build_inputs(tokens, lengths, seg, attention=attention, seg_host=seg_host)
    assert not slept.query(), "building the inputs waited for the GPU's queued work"
    torch.cuda.synchronize()
    assert inp.idx.shape == (B, L)


def test_a_logging_interval_is_read_behind_the_next_step_not_by_draining_the_gpu():
    """Closing an interval queues its loss's copy to the host and returns; the report waits for the interval's
    last step alone, while the step queued after it runs on (runstats.REPORT_BEHIND): the GPU never idles
    while the host prepares a step."""
    from tests.helpers import batch_meta, run_stats

    stats = run_stats(DEV)
    records: list[tuple[int, dict]] = []

    def interval(step: int) -> torch.cuda.Event:
        """A step of a second or so whose loss is made behind it on the same stream, closing an interval."""
        torch.cuda._sleep(1_000_000_000)
        loss = torch.ones((), device=DEV) * 6.0
        end = torch.cuda.Event()
        end.record()
        stats.add_step([batch_meta(4, 3)], loss, 0.0, 1e-3)  # type: ignore[list-item]
        stats.close_interval(
            step, 1e-3, torch.full((), 0.5, device=DEV), lambda n, st: records.append((n, st))
        )
        return end

    # a first interval loads the kernels (a module's first load can wait for the device), as a run's first does
    interval(1)
    stats.report()
    records.clear()
    end = interval(2)
    closed_before_it_ran = not end.query() and not records
    torch.cuda._sleep(2_000_000_000)  # the next step
    next_step = torch.cuda.Event()
    next_step.record()
    stats.report()
    assert closed_before_it_ran, "closing the interval waited for its step"
    assert [(step, st["loss"], st["grad_norm"]) for step, st in records] == [(2, 2.0, 0.5)]
    assert not next_step.query(), "reading the interval waited for the step queued after it"
    torch.cuda.synchronize()


def test_copy_stream_slots_are_released_only_after_their_copy(tmp_path):
    from lmpipe.consumer.slots import HostSlot
    from lmpipe.producer.batching import BatchSpec, batches
    from tests.helpers import ListStream

    (b,) = list(
        batches(
            ListStream([list(range(1, 200))]), BatchSpec(strategy="pack", seq_len=64, batch_size=4), epochs=1
        )
    )
    slot = HostSlot(4, 64, np.dtype("<u2"), pin=True)
    slot.fill(b, 0, 1, "s", 0.0)
    assert slot.tokens.is_pinned()
    copy = torch.cuda.Stream()
    tokens, lengths, seg = slot.views()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy so the copy really runs beside it
    with torch.cuda.stream(copy):
        dev = tokens.to(DEV, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy)
    torch.cuda.current_stream().wait_event(done)
    dev.record_stream(torch.cuda.current_stream())
    done.synchronize()
    assert done.query()
    np.testing.assert_array_equal(dev.cpu().numpy(), b.tokens)


def test_triton_adamw_equals_torchs_fused_on_gpt2_parameters():
    """consumer/fast/adamw.py against torch's fused AdamW on GPT-2 124M's tensors (the embedding spans hundreds of
    chunks, the layer norms one partial chunk each), with a clip's grad_scale on every step."""
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.fast import adamw
    from lmpipe.consumer.step import make_optimizer

    torch.manual_seed(0)
    ours = GPT(preset("gpt2-124m", vocab_size=50257)).cuda()
    ref = GPT(preset("gpt2-124m", vocab_size=50257)).cuda()
    ref.load_state_dict(ours.state_dict())
    cfg = TrainConfig(fused_adamw=True, weight_decay=0.1)
    built = SimpleNamespace(
        tcfg=cfg, optimizer=make_optimizer(ours, cfg, torch.device("cuda")), runner=SimpleNamespace()
    )
    adamw.apply(built)  # type: ignore[arg-type]  # path adamw, as build() applies it
    opt = built.optimizer
    assert isinstance(opt, adamw.AdamW) and built.runner.optimizer is opt
    torch_opt = torch.optim.AdamW(
        [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True,
    )  # fmt: skip
    for step in range(3):
        for a, b in zip(ours.parameters(), ref.parameters()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        scale = torch.tensor(1.0 + step, device="cuda")
        for o in (opt, torch_opt):
            o.grad_scale = scale
            o.step()
            del o.grad_scale
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"])
    assert len(opt._tables) == 2  # one table a group, rebuilt when the new gradients moved
