"""Loss scalers: the same decisions as torch.amp.GradScaler, static mode, skipped steps leave weights alone."""

from __future__ import annotations

import pytest
import torch

from lmpipe.consumer.scaler import DynamicLossScaler, StaticLossScaler, make_scaler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# finite (True) or overflowing (False) gradients, step by step: backoffs, growth, back-to-back overflows
PATTERN = [True, True, True, False, True, True, True, True, False, False, True, True, True, True, True]


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=g).to(device)),
        torch.nn.Parameter(torch.randn(7, generator=g).to(device)),
    ]


def _grads(params, finite: bool, scale: float, step: int):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.device)
        if not finite and i == 1:
            p.grad[3] = float("inf") if step % 2 else float("nan")


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_scaler_decides_like_grad_scaler(device):
    ours_p, ref_p = _params(device), _params(device)
    ours_opt = torch.optim.AdamW(ours_p, lr=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref_p, lr=0.1, fused=True)
    ours = DynamicLossScaler(init_scale=1024.0, device=device, growth_interval=3)
    ref = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3)
    scales = []
    one = torch.ones((), device=device)
    assert ours.scale(one).item() == ref.scale(one).item() == 1024.0  # GradScaler allocates its scale here
    for step, finite in enumerate(PATTERN):
        _grads(ours_p, finite, ours.get_scale(), step)
        _grads(ref_p, finite, ref.get_scale(), step)
        ours.unscale_(ours_opt)
        ref.unscale_(ref_opt)
        for a, b in zip(ours_p, ref_p):
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
        ours.step(ours_opt)
        ref.step(ref_opt)
        ours.update()
        ref.update()
        assert ours.get_scale() == ref.get_scale(), f"step {step}"
        for a, b in zip(ours_p, ref_p):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        scales.append(ours.get_scale())
    overflows, skipped = ours.counters()
    assert overflows == skipped == PATTERN.count(False)
    assert max(scales) > 1024.0 and min(scales) < 1024.0, "the pattern exercised both growth and backoff"


@pytest.mark.parametrize("device", DEVICES)
def test_static_scaler_keeps_its_scale_and_skips_overflows(device):
    params = _params(device)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    scaler = StaticLossScaler(512.0, device=device)
    for step, finite in enumerate(PATTERN):
        before = [p.detach().clone() for p in params]
        _grads(params, finite, 512.0, step)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 512.0
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        assert changed == finite, f"step {step}: finite={finite} but changed={changed}"
    assert scaler.counters() == (PATTERN.count(False), PATTERN.count(False))


@pytest.mark.parametrize("fused", [True, False])
def test_injected_inf_gradient_skips_the_step_and_leaves_parameters_untouched(fused):
    params = _params("cpu")
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused, foreach=None if fused else False)
    scaler = DynamicLossScaler(init_scale=2.0**16, device="cpu")
    before = [p.detach().clone() for p in params]
    _grads(params, False, 1.0, step=1)
    scaler.step(opt)
    scaler.update()
    for b, p in zip(before, params):
        assert torch.equal(b, p)
    assert all(int(opt.state[p]["step"]) == 0 for p in params if p in opt.state)
    assert scaler.get_scale() == 2.0**15


def test_state_dict_round_trip_and_refusals():
    a = DynamicLossScaler(init_scale=300.0, device="cpu", growth_interval=7)
    a._overflows += 2
    b = DynamicLossScaler(device="cpu")
    b.load_state_dict(a.state_dict())
    assert b.get_scale() == 300.0 and b.growth_interval == 7 and b.counters() == (2.0, 0.0)
    with pytest.raises(ValueError, match="dynamic loss scaler"):
        StaticLossScaler(5.0, device="cpu").load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="static:VALUE"):
        make_scaler("static:-3", torch.device("cpu"))
    assert make_scaler("none", torch.device("cpu")) is None
    assert isinstance(make_scaler("static:128", torch.device("cpu")), StaticLossScaler)
