"""The q/k/v projection whose backward reads dq, dk, dv where they are (consumer/fast/qkv_kernel.py) computes what
the plain projection does: its Triton GEMM in Triton's interpreter, the autograd wiring eager and compiled
on CPU (no concatenation of the three gradients left in inductor's code), and the whole model on a GPU."""

from __future__ import annotations

import pytest

from tests.helpers import run_in_triton_interpreter

pytest.importorskip("triton", reason="Triton is not installed (it comes with torch's CUDA wheels)")
CHECK = """
import torch, triton
from lmpipe.consumer.fast import qkv_kernel as K
torch.manual_seed(0)
M, C = 200, 128  # rows not a multiple of any tile; BN 256 wider than C
dq, dk, dv = (torch.randn(M, C) for _ in range(3))
w = torch.randn(3 * C, C)
want = dq @ w[:C] + dk @ w[C : 2 * C] + dv @ w[2 * C :]
for cfg in K._configs():  # every tile the autotuner may pick (the interpreter cannot time them)
    m, n, k = cfg.kwargs["BM"], cfg.kwargs["BN"], cfg.kwargs["BK"]
    out = torch.full((M, C), float("nan"))
    K._dx.fn[(triton.cdiv(M, m) * triton.cdiv(C, n),)](dq, dk, dv, w, out, M, C, BM=m, BN=n, BK=k)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
print("ok")
"""


def test_the_input_gradient_kernel_sums_the_three_gemms_in_the_interpreter():
    out = run_in_triton_interpreter(CHECK)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
