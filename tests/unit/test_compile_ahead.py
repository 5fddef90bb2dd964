"""--compile-ahead (consumer/startup.py): the model compiled on a blank batch while producers connect changes
nothing the run trains with, and the first real batch runs the graph compiled ahead (no second compile)."""

from __future__ import annotations

import pytest
import torch

from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.inputs import MaskCache, build_inputs
from lmpipe.consumer.startup import ahead_possible, blank_inputs, compile_ahead
from lmpipe.shared.config import PipelineConfig
from tests.helpers import masked_packed_batch

PCFG = PipelineConfig(seq_len=256, batch_size=2, strategy="pack")


def _built(device: str, compile: bool):
    torch.manual_seed(0)
    tcfg = TrainConfig(model="tiny", compile=compile, metrics_port=None)
    dtype = torch.bfloat16 if device == "cuda" else None
    return build(PCFG, tcfg, 97, torch.device(device), "bf16" if dtype else "fp32", dtype, Dist())


def test_the_compile_ahead_leaves_weights_optimizer_and_rng_as_they_were():
    built = _built("cpu", compile=False)
    before = {k: v.clone() for k, v in built.model.state_dict().items()}
    rng = torch.get_rng_state()
    compile_ahead(built.runner, blank_inputs(PCFG, 97, torch.device("cpu"), "auto"), torch.device("cpu"))
    after = built.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in built.model.parameters())
    assert not built.optimizer.state  # no step taken: AdamW has no moments yet
    assert torch.equal(torch.get_rng_state(), rng)


def test_only_runs_of_one_shape_and_one_process_compile_ahead():
    on = TrainConfig(compile=True)
    assert ahead_possible(PCFG, on, distributed=False)
    assert not ahead_possible(PipelineConfig(strategy="bucket", pad_multiple=64), on, distributed=False)
    assert not ahead_possible(PCFG, on, distributed=True)
    assert not ahead_possible(PCFG, TrainConfig(compile=True, compile_ahead=False), distributed=False)
    assert not ahead_possible(PCFG, TrainConfig(compile=False), distributed=False)


@pytest.mark.cuda
def test_the_first_real_batch_runs_the_graph_compiled_ahead():
    """On CUDA: FlexAttention's block mask from the host copy of seg, tokens as uint16 copied to the GPU, as
    consumer/feed.py makes them; the fast paths as --fast auto applies them."""
    device = torch.device("cuda")
    built = _built("cuda", compile=True)
    counters = torch._dynamo.utils.counters["stats"]
    compile_ahead(built.runner, blank_inputs(PCFG, 97, device, "auto"), device)
    graphs = counters["unique_graphs"]
    assert graphs >= 1
    tokens, lengths, seg, mask = masked_packed_batch(PCFG.seq_len, 0)
    real = build_inputs(tokens.to(torch.uint16).to(device), lengths.to(device), seg.to(device), attention="auto",
                        mask_cache=MaskCache(), loss_mask=mask.to(device), seg_host=seg.numpy())  # fmt: skip
    loss, norm = built.runner.step([real], float((real.targets >= 0).sum()), 1e-3)
    assert torch.isfinite(loss) and torch.isfinite(norm)
    assert counters["unique_graphs"] == graphs, "the first real batch compiled again"


def test_the_summary_and_the_first_step_line_say_how_the_time_split():
    from lmpipe.consumer.report import Summary
    from lmpipe.consumer.startup import say_split

    split = {"total": 12.34, "startup": 4.1, "compile": 7.9, "first_batch_wait": 0.3, "first_step": 0.0,
             "compiled_ahead": True, "first_step_recompiles": 0, "compile_cache": "warm"}  # fmt: skip
    assert say_split(split) == ("first step after 12.3 s: start-up 4.1 s, compile 7.9 s (ahead, while producers "
                                "connected), first batch wait 0.3 s, compile cache warm")  # fmt: skip
    s = Summary(steps=3, first_step_split=split, losses=[1.0, 0.9])
    assert (
        "first step 12.3 s after start (start-up 4.1 s, compile 7.9 s, cache warm, 0.3 s waiting for data)"
        in (s.render())
    )
    plain = {**split, "compile": 0.0, "first_step": 0.2, "compiled_ahead": False, "compile_cache": "off"}
    assert say_split(plain) == "first step after 12.3 s: start-up 4.1 s, step 0.2 s, first batch wait 0.3 s"
    again = say_split({**split, "first_step_recompiles": 2})
    assert again.endswith("; the first step compiled 2 more graph(s) than the one made ahead")
