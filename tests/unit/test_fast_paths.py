"""The fast paths' registry (consumer/fast/): --fast's parsing and refusals, the one log line, each path's
reasons for not running, and --fast none building the plain model, optimizer and step."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from lmpipe.consumer import fast
from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast.liger import LigerLoss
from lmpipe.consumer.model import GPT, MLP, CausalSelfAttention, GPTConfig
from lmpipe.consumer.step import StepRunner
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError


def _build(spec: str, device: str = "cpu", **kw):
    tcfg = TrainConfig(model="tiny", fast=spec, metrics_port=None, **kw)
    return build(PipelineConfig(seq_len=64), tcfg, 97, torch.device(device), "fp32", None, Dist())


def _path(name: str) -> fast.Path:
    return next(p for p in fast.PATHS if p.name == name)


def test_the_setting_takes_auto_none_and_lists_of_paths():
    assert fast.parse("auto") == fast.Choice(True, frozenset(), frozenset())
    assert fast.parse("none") == fast.Choice(False, frozenset(), frozenset())
    assert fast.parse("adamw, step-graph") == fast.Choice(
        False, frozenset({"adamw", "step-graph"}), frozenset()
    )
    both = fast.parse("auto,qkv-backward,-step-graph")
    assert both == fast.Choice(True, frozenset({"qkv-backward"}), frozenset({"step-graph"}))
    assert both.wants(_path("qkv-backward")) and both.wants(_path("adamw"))
    assert not both.wants(_path("step-graph")) and not both.wants(_path("memset-nodes"))
    # the paths measured within noise are opt-in: auto leaves them off
    assert {p.name for p in fast.PATHS if not p.default} == {"qkv-backward", "memset-nodes"}


@pytest.mark.parametrize(
    "spec, says",
    [
        ("bogus", "'bogus' is no fast path; choose from loss-kernel"),
        ("adamw,-step-graph", "write auto,-step-graph"),
        ("", "empty; use auto, none"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_flag(spec, says):
    with pytest.raises(SettingsError) as e:
        TrainConfig(fast=spec)
    assert str(e.value).startswith("--fast") and says in str(e.value) and "\n" not in str(e.value)


def test_none_builds_the_plain_model_optimizer_and_step():
    built = _build("none")
    assert type(built.model) is GPT and type(built.runner) is StepRunner and built.fast == []
    assert all(
        type(m) in (MLP, CausalSelfAttention) for b in built.model.transformer.h for m in (b.mlp, b.attn)
    )
    assert type(built.optimizer) is torch.optim.AdamW and not built.runner.clip_in_step
    assert (
        built.fast_line
        == "fast paths (--fast none): none; off: " + ", ".join(fast.NAMES) + " (not asked for)"
    )


def test_auto_on_a_cpu_runs_what_can_and_says_why_not_in_one_line():
    built = _build("auto")
    assert built.fast == ["clip-in-step"] and built.runner.clip_in_step
    line = built.fast_line
    assert line.startswith(
        "fast paths (--fast auto): clip-in-step; off: loss-kernel (it needs CUDA, not cpu);"
    )
    assert "qkv-backward (opt-in: --fast auto,qkv-backward)" in line and "memset-nodes (opt-in" in line
    # the reference and auto train the same tiny model to the same loss on a CPU (the clip's placement aside)
    assert type(built.model) is GPT


def test_a_named_path_that_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--fast loss-kernel: it needs CUDA, not cpu$"):
        _build("loss-kernel")
    with pytest.raises(ValueError, match=r"^--fast clip-in-step: --grad-clip 0: nothing to clip$"):
        _build("clip-in-step", grad_clip=0.0)
    with pytest.raises(ValueError, match="foreach AdamW"):
        _build("clip-in-step", fused_adamw=False)
    assert _build("clip-in-step").fast == ["clip-in-step"]


def _cuda_build(precision: str = "bf16", applied: tuple[str, ...] = (), **cfg) -> SimpleNamespace:
    """What the paths' unavailable() read of a build, as a bf16 CUDA run would have it."""
    tcfg = TrainConfig(model="tiny", metrics_port=None, **{k: v for k, v in cfg.items() if k != "model"})
    dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)
    runner = SimpleNamespace(no_sync=None, scaler=None, cudagraphs=False, strategy="pack")
    return SimpleNamespace(device=torch.device("cuda"), precision=precision, autocast_dtype=dtype, tcfg=tcfg,
                           fast=list(applied), runner=runner, scaler=None, optimizer=object(),
                           model=SimpleNamespace(config=cfg.get("model", GPTConfig())))  # fmt: skip


def _liger_build() -> SimpleNamespace:
    built = _cuda_build()
    built.model = LigerLoss.__new__(LigerLoss)  # --fused-ce with liger installed: all the check reads
    return built


@pytest.mark.parametrize(
    "name, build_, says",
    [
        ("loss-kernel", _cuda_build("fp16"), "fp16"),
        ("loss-kernel", _liger_build(), "--fused-ce"),
        ("head-gemm", _cuda_build(), "loss-kernel's GEMMs, and it is off"),
        ("head-gemm", _cuda_build("fp32", ("loss-kernel",)), "bf16 GEMMs; this run's matmuls are fp32"),
        ("gelu-epilogue", _cuda_build("fp16"), "bf16, not fp16"),
        ("gelu-epilogue", _cuda_build(model=GPTConfig(bias=True)), "biases"),
        ("qkv-backward", _cuda_build(model=GPTConfig(n_embd=128)), "under 768"),
        ("qkv-backward", _cuda_build(model=GPTConfig(n_embd=800)), "multiple of 64"),
        ("adamw", _cuda_build(fused_adamw=False), "--no-fused-adamw"),
        ("clip-in-step", _cuda_build(), "cannot scale gradients"),
        ("step-graph", _cuda_build(accum=2, applied=("adamw",)), "--accum 1"),
        ("step-graph", _cuda_build(), "Triton AdamW"),
        ("memset-nodes", _cuda_build(), "the step graph, which is off"),
    ],
)
def test_each_path_says_why_it_cannot_run(name, build_, says):
    path = _path(name)
    if any(importlib.util.find_spec(p) is None for p in path.needs):
        pytest.skip(f"{path.needs} not installed")
    assert says in (fast.unavailable(path, build_) or "")


def test_mix_composes_subclasses_and_keeps_the_parameters():
    class A(CausalSelfAttention):
        def project(self, x):
            return super().project(x)

    class B(CausalSelfAttention):
        def attend(self, q, k, v, attn):
            return super().attend(q, k, v, attn)

    attn = CausalSelfAttention(GPTConfig(n_embd=64, n_head=4))
    before = dict(attn.state_dict())
    fast.mix(attn, A)
    fast.mix(attn, B)
    fast.mix(attn, A)  # already one: unchanged
    assert isinstance(attn, A) and isinstance(attn, B) and type(attn).__mro__.count(A) == 1
    assert attn.state_dict().keys() == before.keys()
    assert all(torch.equal(attn.state_dict()[k], v) for k, v in before.items())


def test_varlen_inputs_without_flash_attention_are_one_clear_error():
    from lmpipe.consumer.model import AttnSpec

    attn = CausalSelfAttention(GPTConfig(n_embd=64, n_head=4))
    with pytest.raises(ValueError, match="--attention flash"):
        attn(torch.zeros(1, 8, 64), AttnSpec("varlen", cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)))


def test_a_cuda_path_named_for_a_cpu_run_is_refused_before_anything_starts():
    with pytest.raises(
        SettingsError, match=r"^--fast qkv-backward needs a CUDA GPU; --device cpu is the CPU$"
    ):
        TrainConfig(device="cpu", fast="auto,qkv-backward")
    assert TrainConfig(device="cpu", fast="auto").cross_check() == []
    assert TrainConfig(device="cpu", fast="clip-in-step").cross_check() == []
