"""Path step-graph (consumer/fast/step_graph.py): the whole training step captured as CUDA graphs trains as the eager
step does, follows the lr schedule and the loss's denominator, and steps eagerly where it cannot capture."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.fast import PATHS
from lmpipe.consumer.fast import step_graph as SG
from lmpipe.consumer.fast import unavailable as path_unavailable
from lmpipe.consumer.fast.step_graph import GRAPH_AFTER, GraphedSteps, _static_copy, _tensors, shape_key
from lmpipe.consumer.inputs import build_inputs
from lmpipe.shared.config import PipelineConfig
from tests.helpers import masked_packed_batch


def _built(device: str, step_graph: bool, compile: bool = False, **kw):
    torch.manual_seed(0)
    fast = "auto" if step_graph else "auto,-step-graph"
    tcfg = TrainConfig(model="tiny", compile=compile, fast=fast, grad_clip=1.0, metrics_port=None, **kw)
    dtype = torch.bfloat16 if device == "cuda" else None
    return build(PipelineConfig(seq_len=256), tcfg, 97, torch.device(device), "bf16" if dtype else "fp32", dtype,
                 Dist())  # fmt: skip


def _batch(seed: int, L: int = 256, device: str = "cuda"):
    tokens, lengths, seg, mask = (t.to(device) for t in masked_packed_batch(L, seed))
    return build_inputs(
        tokens, lengths, seg, attention="flex" if device == "cuda" else "dense", loss_mask=mask
    )


def _train(built, lengths: list[int]) -> list[float]:
    losses = []
    for i, L in enumerate(lengths):
        inp = _batch(i, L)
        denom = float((inp.targets >= 0).sum())
        loss, norm = built.runner.step([inp], denom, 1e-3 * (1 + i % 4))  # lr changes every step
        losses.append(float(loss) / denom)
        assert torch.isfinite(norm)
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True], ids=["eager-model", "compiled"])
def test_a_captured_step_trains_as_the_eager_step(compile):
    """The 4th step in a row of one shape captures (and trains), the rest replay; a 128-token batch before
    that restarts the count (a short batch is not the shape the run keeps), one after it steps eagerly beside
    the graph. Same losses and weights as an all-eager run, every step."""
    lengths = [256] * GRAPH_AFTER + [128] + [256] * (GRAPH_AFTER + 3) + [128] + [256] * 3
    eager, graphed = _built("cuda", False, compile), _built("cuda", True, compile)
    want, got = _train(eager, lengths), _train(graphed, lengths)
    graph = graphed.runner._graph
    assert (
        graph is not None and not isinstance(eager.runner, GraphedSteps) and graph.static.idx.shape[1] == 256
    )
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    # bf16 kernels compiled under autocast's cache on and off round differently (1.0e-3 seen, H100); an lr
    # or denominator the graph failed to follow moves the weights by ~5e-2 over these steps
    for (name, a), (_, b) in zip(graphed.model.named_parameters(), eager.model.named_parameters()):
        assert (a - b).norm() <= 4e-3 * b.norm(), name
    # the optimizer counted every step once, replayed or not
    steps = {float(s["step"]) for s in graphed.optimizer.state.values()}
    assert steps == {float(len(lengths))}


@pytest.mark.cuda
def test_step_graph_says_why_it_cannot_capture():
    accum = _built("cuda", True, accum=2)  # the trainer logs fast_line after a resume's checks
    assert (
        not accum.runner.graphs
        and "step-graph (it captures one micro-batch a step (--accum 1))" in accum.fast_line
    )


@pytest.mark.cuda
@pytest.mark.parametrize("phase", ["forward_backward", "clip_and_update"])
def test_a_step_that_cannot_be_captured_trains_eagerly_and_says_why(phase, monkeypatch, caplog):
    """A host sync inside the captured work (as an uncapturable library call would make) fails the capture:
    one warning, and training goes on eagerly with nothing lost or trained twice, the same as an eager run."""
    lengths = [256] * (GRAPH_AFTER + 4)
    eager = _built("cuda", False)
    want = _train(eager, lengths)
    del eager
    base = _reserved()
    graphed = _built("cuda", True)
    real = {"fn": getattr(graphed.runner, phase)}  # held here, so the run can be let go of at the end

    def syncing(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return real["fn"](*args, **kwargs)

    monkeypatch.setattr(graphed.runner, phase, syncing)
    with caplog.at_level(logging.WARNING, logger="lmpipe.trainer"):
        got = _train(graphed, lengths)
    assert graphed.runner._graph is None and not graphed.runner.graphs
    assert caplog.text.count("cannot be captured as CUDA graphs") == 1
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    steps = {float(s["step"]) for s in graphed.optimizer.state.values()}
    assert steps == {float(len(lengths))}
    assert all(isinstance(g["lr"], float) for g in graphed.optimizer.param_groups), "checkpoints keep a float"
    # nothing left in capture mode: the current stream is the default one again, and the allocator frees
    # blocks another stream used (the feed's record_stream) instead of parking them while "a capture is on"
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(8, device="cuda")  # the CUDA RNG too (dropout): it raised here, out of capture mode
    other = torch.cuda.Stream()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(8):
        x = torch.empty(1 << 22, device="cuda")
        x.record_stream(other)
        del x
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation makes the allocator look at finished streams' events
    assert torch.cuda.memory_allocated() - before < 1 << 22
    # and the failed capture's pool goes back once the run is gone (the graph's activations are not kept)
    monkeypatch.undo()
    real.clear()
    del graphed
    assert _reserved() <= base + (2 << 20)


def _reserved() -> int:
    """The GPU memory torch's allocator holds once nothing unreferenced is cached."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # one per (handle, stream): the capture's side stream made one
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def test_on_a_cpu_the_step_runs_eagerly_and_says_why():
    built = _built("cpu", True)
    assert not built.runner.graphs and not isinstance(built.runner, GraphedSteps)
    path = next(p for p in PATHS if p.name == "step-graph")
    assert path_unavailable(path, built) == "it needs CUDA, not cpu"
    losses = []
    inp = _batch(0, 64, "cpu")
    for _ in range(GRAPH_AFTER + 2):  # past the point where a CUDA runner would capture
        loss, _ = built.runner.step([inp], float((inp.targets >= 0).sum()), 1e-2)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_batches_that_change_shape_are_not_captured():
    """A graph holds one shape's activations; eager steps beside it for the others would double them."""
    for strategy, problem in [("pad-batch", True), ("bucket", True), ("pad", False), ("pack", False)]:
        built = _built("cpu", True)  # the path's own reasons, past the registry's CUDA check
        built.runner.strategy = strategy
        why = SG.unavailable(built) or ""
        assert ("changes the batches' shape" in why) == problem, (strategy, why)
    assert "Triton AdamW" in (SG.unavailable(built) or "")  # path adamw needs CUDA: not applied on a CPU
    built.tcfg.precision = "fp8"  # torchao's float8 scaling has not run under capture
    assert "float8" in (SG.unavailable(built) or "")
    built.tcfg.fused_ce = True  # liger's .item() a step: every capture would fail
    assert "--fused-ce" in (SG.unavailable(built) or "")


def test_nvmath_gemms_that_cannot_be_captured_are_refused_before_capture(monkeypatch):
    """Only the direct cuBLASLt call can be captured: with it off, or with plans of an nvmath-python that lacks
    what it reads, the step graph is refused up front (CaptureFailed with nothing trained), not attempted."""
    from lmpipe.consumer.fast import cublaslt
    from lmpipe.consumer.fast.step_graph import CaptureFailed, StepGraph

    class OldPlan:  # a planned Matmul of an nvmath-python without the direct call's attributes
        num_operands = 2

    monkeypatch.setattr(cublaslt, "_plans", {("key",): OldPlan()})
    runner = _built("cpu", True).runner
    with pytest.raises(CaptureFailed, match="lack what the direct cuBLASLt call reads") as e:
        StepGraph(runner, _batch(0, 64, "cpu"), 1.0, 1e-3)
    assert e.value.result is None
    monkeypatch.setattr(cublaslt, "DIRECT", False)
    with pytest.raises(CaptureFailed, match=r"Matmul.execute\(\), which cannot be captured"):
        StepGraph(runner, _batch(0, 64, "cpu"), 1.0, 1e-3)


def test_a_graphs_static_batch_is_its_own_copy_and_its_mask_reads_it():
    """The static batch every replay reads: same shapes and values as the batch it was made from, its own
    memory (a replay's copy must not write into the feed's buffers), and a block mask whose mask_mod reads the
    static document ids, so copying the next batch's ids in changes what it masks."""
    tokens, lengths, seg, mask = masked_packed_batch(256, 0)
    inp = build_inputs(tokens, lengths, seg, attention="flex", loss_mask=mask)
    static = _static_copy(inp)
    assert shape_key(static) == shape_key(inp) is not None
    for a, b in zip(_tensors(static) or [], _tensors(inp) or []):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    sseg = static.attn.seg
    assert sseg is not None
    q = int(torch.nonzero(sseg[0, 1:] == sseg[0, :-1])[0]) + 1  # a position in the same document as q - 1
    b, h, qi, kv = torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(q - 1)
    mod = static.attn.block_mask.mask_mod  # type: ignore[union-attr]
    assert bool(mod(b, h, qi, kv))
    sseg[0, q - 1] = sseg[0, q] + 1  # as a replay's copy of another batch would
    assert not bool(mod(b, h, qi, kv))
    assert bool(inp.attn.block_mask.mask_mod(b, h, qi, kv))  # type: ignore[union-attr]  # the batch's own: unchanged


def test_a_memset_node_becomes_whole_aligned_words():
    """consumer/fast/memset_nodes.py stores a memset's bytes as 32-bit words, or leaves a node it cannot (2-D,
    unaligned, not whole words) as it is."""
    from lmpipe.consumer.fast.memset_nodes import Fill, as_words

    assert as_words(0x1000, 0, 1, 4, 1) == Fill(0x1000, 0, 1)  # cuBLASLt's: 4 bytes of zeros
    assert as_words(0x1000, 0x1AB, 1, 8, 1) == Fill(0x1000, 0xABABABAB, 2)  # a byte value is its low 8 bits
    assert as_words(0x1000, 0x1234, 2, 6, 1) == Fill(0x1000, 0x12341234, 3)
    assert as_words(0x1000, 0xDEADBEEF, 4, 5, 1) == Fill(0x1000, 0xDEADBEEF, 5)
    assert as_words(0x1002, 0, 1, 4, 1) is None  # unaligned
    assert as_words(0x1000, 0, 1, 6, 1) is None  # not whole words
    assert as_words(0x1000, 0, 4, 4, 2) is None  # 2-D
    assert as_words(0x1000, 0, 8, 4, 1) is None  # no such element size


@pytest.mark.cuda
def test_memset_nodes_become_kernel_nodes_that_write_the_same_bytes():
    """cuBLASLt's workspace memsets in a captured graph (split-K weight gradients need them) become kernel
    nodes: none left, and the GEMMs' results equal, bit for bit, those of the same work captured unedited."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from lmpipe.consumer.fast import memset_nodes

    def memsets(graph: torch.cuda.CUDAGraph) -> int:
        g = driver.CUgraph(graph.raw_cuda_graph())
        _, _, n = driver.cuGraphGetNodes(g, 0)
        _, nodes, _ = driver.cuGraphGetNodes(g, n)
        kinds = [driver.cuGraphNodeGetType(x)[1] for x in nodes]
        return sum(k == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET for k in kinds)

    torch.manual_seed(0)
    pairs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda",
              dtype=torch.bfloat16)) for m, k, n in [(768, 16384, 768), (4096, 768, 3072), (2304, 16384, 768)]]  # fmt: skip

    def work():
        return [a @ b for a, b in pairs for _ in range(2)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    plain, edited = torch.cuda.CUDAGraph(keep_graph=True), torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(plain, stream=side):
        want = work()
    with torch.cuda.graph(edited, stream=side):
        got = work()
    before = memsets(edited)
    assert before > 0, "no memset captured: this cuBLAS gives the test nothing to rewrite"
    assert memset_nodes.rewrite(edited, torch.device("cuda")) == before
    assert memsets(edited) == 0
    plain.instantiate()
    edited.instantiate()
    for x in got:
        x.fill_(float("nan"))
    for _ in range(3):
        plain.replay()
        edited.replay()
    torch.cuda.synchronize()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
