"""The one-pass loss kernel (consumer/fast/loss.py) on CPU, through Triton's interpreter: the loss and both
gradients equal torch's cross-entropy. tests/unit/test_cuda.py runs it compiled, in bf16, on a GPU."""

from __future__ import annotations

import pytest

from tests.helpers import run_in_triton_interpreter

pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")

CHECK = """
import torch, torch.nn.functional as F
from lmpipe.consumer.fast import loss as L
L.BLOCK = 128  # several blocks a row, the last one partial
torch.manual_seed(0)
n, c, v = 48, 16, 300
for upstream in (1.0, 0.37):
    h = torch.randn(n, c, requires_grad=True)
    w = torch.randn(v, c, requires_grad=True)
    t = torch.randint(0, v, (n,))
    t[::5] = -100  # ignored targets
    t[0], t[1] = 0, v - 1  # the first and the last vocabulary entry
    got = L._HeadLoss.apply(h, w, t, -100, False)
    (got * upstream).backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    want = F.cross_entropy(h2 @ w2.t(), t, ignore_index=-100, reduction="sum")
    (want * upstream).backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    # every target ignored: no loss, no gradient
    t[:] = -100
    h.grad = None
    L._HeadLoss.apply(h, w, t, -100, False).backward()
    assert float(L._HeadLoss.apply(h, w, t, -100, False)) == 0.0 and not h.grad.any()
# the kernel's switches (bench.loss times them) change where it reads from, not what it computes
logits = torch.randn(n, v)
t = torch.randint(0, v, (n,))
t[::5] = -100
want = None
for hints in (True, False):
    for from_end in (True, False):
        x, losses = logits.clone(), torch.empty(n)
        L._ce_rows[(n,)](x, x.stride(0), t, losses, v, -100, BLOCK=128, HINTS=hints, FROM_END=from_end)
        want = want or (x, losses)
        assert torch.equal(x, want[0]) and torch.equal(losses, want[1]), (hints, from_end)
print("ok")
"""


def test_loss_kernel_equals_torchs_cross_entropy_in_the_interpreter():
    out = run_in_triton_interpreter(CHECK)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
