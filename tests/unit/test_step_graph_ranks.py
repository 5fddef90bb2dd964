"""Under torchrun a step capture is collective (NCCL's all-reduces are in the graph): every rank asks the
others at every eager step, ready only after DDP's 11 eager steps of one shape, and captures only when all
are ready. The capture itself needs CUDA; here the agreement that decides it, and the opt-in."""

from __future__ import annotations

import contextlib

import torch

from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import mix
from lmpipe.consumer.fast import step_graph as SG
from lmpipe.consumer.fast.step_graph import GRAPH_AFTER_DDP, GraphedSteps
from lmpipe.consumer.inputs import build_inputs
from lmpipe.shared.config import PipelineConfig
from tests.helpers import masked_packed_batch


def _runner(fast: str = "auto"):
    torch.manual_seed(0)
    tcfg = TrainConfig(model="tiny", fast=fast, metrics_port=None)
    built = build(PipelineConfig(seq_len=64), tcfg, 97, torch.device("cpu"), "fp32", None, Dist())
    return built


def _batch(seed: int, L: int):
    tokens, lengths, seg, mask = masked_packed_batch(L, seed)
    return build_inputs(tokens, lengths, seg, attention="dense", loss_mask=mask)


def test_every_rank_is_asked_at_every_eager_step_and_ready_only_after_ddps_warm_up():
    built = _runner()
    runner = built.runner
    mix(runner, GraphedSteps)  # what apply() does on CUDA; here nothing is captured (the others never agree)
    runner.graphs = True
    runner.no_sync = contextlib.nullcontext  # as under DDP
    asked: list[bool] = []
    runner.all_ranks = lambda ready: asked.append(ready) or False
    lengths = [64] * 5 + [32] + [64] * (GRAPH_AFTER_DDP + 2)
    for i, L in enumerate(lengths):
        inp = _batch(i, L)
        runner.step([inp], float((inp.targets >= 0).sum()), 1e-3)
    assert len(asked) == len(lengths), "asked at every step, a short batch's too"
    # ready from the 12th step in a row of one shape on: the short batch restarted the count
    first_ready = asked.index(True)
    assert first_ready == 6 + GRAPH_AFTER_DDP and all(asked[first_ready:]) and not any(asked[:first_ready])
    assert runner._graph is None  # the others said no: nobody captured


def test_under_torchrun_the_step_graph_is_opt_in():
    built = _runner()
    built.runner.no_sync = contextlib.nullcontext
    built.runner.capture_stream = object()  # as DDP built on CUDA leaves it
    assert "opt-in" in (SG.unavailable(built) or "")
    built.tcfg.fast = "auto,step-graph"
    assert "opt-in" not in (SG.unavailable(built) or "")
    built.tcfg.grad_reduce = "bf16"
    assert "--grad-reduce bf16" in (SG.unavailable(built) or "")
