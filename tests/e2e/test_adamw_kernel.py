"""The Triton AdamW (consumer/fast/adamw.py) on CPU, through Triton's interpreter: the same weights, moments and
step counters as torch's AdamW over several steps, with a clip's grad_scale, a changing lr (a tensor in the
last step), gradients that move between steps and two parameter groups; the state loads into torch's AdamW. tests/unit/test_cuda.py runs it
on a GPU."""

from __future__ import annotations

import pytest

from tests.helpers import run_in_triton_interpreter

pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")

CHECK = """
import copy
import torch
from lmpipe.consumer.fast import adamw as A
A.CHUNK, A.BLOCK = 256, 64  # several chunks a tensor, the last one partial, several blocks a chunk
torch.manual_seed(0)
shapes = [(30, 20), (1000,), (5,), (256,), (17, 40)]
ours = [torch.randn(s) for s in shapes]
ref = [w.clone() for w in ours]
groups = lambda ws: [{"params": ws[:2] + ws[4:], "weight_decay": 0.1}, {"params": ws[2:4], "weight_decay": 0.0}]
opt = A.AdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
torch_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
real_step = torch.optim.AdamW.step
def no_fallback(*args, **kwargs):
    raise AssertionError("a tensor lr went to torch's AdamW, not the kernel")
# the last step's lr is a tensor, as a captured CUDA graph's step reads it: the kernel takes it
for step, (lr, scale) in enumerate([(1e-2, None), (3e-3, 2.5), (5e-3, None), (5e-3, 1.0), (2e-3, None)]):
    tensor_lr = step == 4
    grads = [torch.randn(s) for s in shapes]
    for w, r, g in zip(ours, ref, grads):
        if step == 2:  # the same gradient tensors as the step before, updated in place: the table is kept
            w.grad.copy_(g)
        else:
            w.grad = g.clone()
        r.grad = g / scale if scale else g.clone()
    for o in (opt, torch_opt):
        for g in o.param_groups:
            g["lr"] = torch.tensor(lr) if (tensor_lr and o is opt) else lr
    if scale:
        opt.grad_scale = torch.tensor(scale)
    torch.optim.AdamW.step = no_fallback if tensor_lr else real_step
    opt.step()
    torch.optim.AdamW.step = real_step
    if scale:
        del opt.grad_scale
    torch_opt.step()
    for w, r in zip(ours, ref):
        torch.testing.assert_close(w, r, rtol=2e-5, atol=2e-6)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[w][k].float(), torch_opt.state[r][k].float(), rtol=2e-5, atol=1e-7)
assert opt.state[ours[0]]["step"].item() == 5.0
for g in opt.param_groups:
    g["lr"] = 5e-3
# the checkpoint format is torch's: our state loads into torch's AdamW and steps on alike
back = [w.clone() for w in ours]
other = torch.optim.AdamW(groups(back), lr=5e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
other.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint would: no shared tensors
g = [torch.randn(s) for s in shapes]
for w, b, gi in zip(ours, back, g):
    w.grad, b.grad = gi.clone(), gi.clone()
opt.step(), other.step()
for w, b in zip(ours, back):
    torch.testing.assert_close(w, b, rtol=2e-5, atol=2e-6)
# what the kernel does not take goes to torch's fused AdamW: a loss scaler's found_inf skips the step
opt.found_inf, opt.grad_scale = torch.ones(()), None
before = [w.clone() for w in ours]
opt.step()
del opt.found_inf, opt.grad_scale
assert all(torch.equal(w, b) for w, b in zip(ours, before))
print("ok")
"""


def test_triton_adamw_equals_torchs_in_the_interpreter():
    out = run_in_triton_interpreter(CHECK)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
