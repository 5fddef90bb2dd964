"""Issue 42, compiles of seconds: --compile-scope blocks compiles each transformer block on its own, in place,
so that Dynamo traces one block and the others reuse its graph; the compile cache tells the two scopes apart
(in-process: lmpipe's GPT and a transformers GPT-2 built from a local config, compiled by inductor on CPU)."""

from __future__ import annotations

import pytest
import torch

from lmpipe.consumer.build import blocks, wrap
from lmpipe.consumer.compile_cache import differences
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.model import AttnSpec
from lmpipe.consumer.startup import cache_key
from lmpipe.shared.config import PipelineConfig
from tests.helpers import tiny_model

CPU = torch.device("cpu")


def test_blocks_are_compiled_in_place_and_traced_once_for_all():
    model = tiny_model()
    assert len(model.transformer.h) == 2
    pcfg, tcfg = PipelineConfig(seq_len=32), TrainConfig(compile=True, compile_scope="blocks")
    torch._dynamo.reset()  # clears compiled code, not the counters: counted from here
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    step_model, _, _ = wrap(model, pcfg, tcfg, CPU, Dist())
    assert step_model is model, "the model is called as it is; its blocks carry the compiled code"
    assert all(b._compiled_call_impl is not None for b in model.transformer.h)
    x = torch.randn(2, 32, model.config.n_embd, requires_grad=True)
    eager = tiny_model()
    attn = AttnSpec("causal")
    with torch.no_grad():
        want = eager.transformer.h[1](eager.transformer.h[0](x, attn), attn)
    got = model.transformer.h[1](model.transformer.h[0](x, attn), attn)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1, "the second block reused it"


def test_a_model_scope_wraps_the_whole_model():
    model = tiny_model()
    step_model, _, _ = wrap(model, PipelineConfig(seq_len=32), TrainConfig(compile=True), CPU, Dist())
    assert step_model is not model and getattr(step_model, "_orig_mod", None) is model
    assert all(b._compiled_call_impl is None for b in model.transformer.h)


def test_a_hugging_face_models_blocks_are_its_decoder_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    found = blocks(model)
    assert [type(b).__name__ for b in found] == ["GPT2Block"] * 3
    model._no_split_modules = []
    with pytest.raises(ValueError, match="--compile-scope blocks: GPT2LMHeadModel names no repeated block"):
        blocks(model)


def test_a_cache_compiled_for_the_other_scope_is_not_trusted():
    pcfg = PipelineConfig(seq_len=32)
    keys = [cache_key(pcfg, TrainConfig(compile=True, compile_scope=s), {}, CPU, "fp32", [], 1)
            for s in ("model", "blocks")]  # fmt: skip
    assert differences(keys[0], keys[1]) == ["compile_scope model (this run: blocks)"]
