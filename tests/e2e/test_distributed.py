"""Several trainer ranks under torchrun (gloo on CPU; NCCL is the same code on GPUs): each rank with its
own producers and a disjoint share of the corpus, every document trained once, one update per step for the
whole job, checkpoints that hold every rank's cursors."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.inputs import build_inputs
from lmpipe.consumer.model import IGNORE
from lmpipe.consumer.step import StepRunner
from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    rank_logs,
    read_doc_log,
    run_lmpipe,
    tiny_model,
)

DOCS = 240
COMMON = ["--producers", "1", "--epochs", "1", "--builtin-docs", str(DOCS), "--seq-len", "64",
          "--metrics-port", "-1", "--log-every", "5", "--threads", "1"]  # fmt: skip


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """Two micro-batches with different numbers of targets (unequal shares must still weigh per token)."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, 97, (2, 32), generator=g), torch.tensor([32, 9], dtype=torch.int32), None),
        (torch.randint(0, 97, (2, 32), generator=g), torch.tensor([5, 20], dtype=torch.int32), None),
    ]


def one_step(rank: int, world: int, init: str, out: str) -> None:
    """Rank `rank` of `world` (world 1: one process accumulating every micro-batch) takes one SGD step."""
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = tiny_model(seed=3).train()
    inputs = [build_inputs(*b) for b in (micro_batches() if world == 1 else [micro_batches()[rank]])]
    targets = sum(int((inp.targets != IGNORE).sum()) for inp in inputs)
    d = Dist(rank, world, rank, dist.group.WORLD if world > 1 else None)
    all_targets, _, _ = d.agree(targets, True, False)
    ddp = DistributedDataParallel(model) if world > 1 else None
    # SGD: the update is the gradient itself, so any difference in the reduced gradient shows
    runner = StepRunner(
        ddp or model, torch.optim.SGD(model.parameters(), lr=1.0), TrainConfig(grad_clip=0.0), None
    )  # clipping would hide a scale error
    runner.step(inputs, all_targets / world, lr=1.0)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    if world > 1:
        dist.barrier()
        sys.stdout.flush()
        # Not destroy_process_group + return: freeing DDP's Reducer joins gloo's worker threads while
        # holding the GIL, and a worker that is releasing a finished allreduce waits for the GIL: a
        # deadlock seen once in a full run (torch 2.13, py-spy: ~ProcessGroupGloo under Reducer dealloc).
        os._exit(0)


def test_ranks_make_the_update_of_one_process_over_all_their_batches(tmp_path):
    one_step(0, 1, "", str(tmp_path / "one.pt"))
    ctx = mp.spawn(one_step, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path / "ddp.pt")), nprocs=2,
                   join=False)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in 120 s")
    single = torch.load(tmp_path / "one.pt")
    ranks = torch.load(tmp_path / "ddp.pt")
    assert not torch.equal(single[0], tiny_model_params()[0]), "the step changed the weights"
    for a, b in zip(single, ranks):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def tiny_model_params() -> list[torch.Tensor]:
    return [p.detach() for p in tiny_model(seed=3).parameters()]


@pytest.mark.slow
def test_two_ranks_train_every_document_once_and_learn_like_one(tmp_path, port, tok):
    rc, text = run_lmpipe(tmp_path, "ddp", "run", *COMMON, "--batch-size", "4", "--steps", "0", "--port", str(port),
                      "--doc-log", str(tmp_path / "docs.jsonl"), "--summary-json", str(tmp_path / "ddp.json"),
                      nproc=2)  # fmt: skip
    assert rc == 0, text[-3000:]
    logs = rank_logs(tmp_path, "docs")
    assert [p.name for p in logs] == ["docs.rank0.jsonl", "docs.rank1.jsonl"]
    pieces: dict[int, list[tuple[int, int]]] = {}
    per_rank = []
    for p in logs:
        mine = read_doc_log(p)
        per_rank.append(set(mine))
        for did, parts in mine.items():
            pieces.setdefault(did, []).extend(parts)
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1], "each rank has its own share"
    assert_exactly_once(pieces, builtin_lengths(tok, DOCS))
    ddp = json.loads((tmp_path / "ddp.json").read_text())  # written by rank 0 only, for the whole job
    assert ddp["stopped_by"] == "end of data" and ddp["tokens"] == sum(
        n for n in builtin_lengths(tok, DOCS).values()
    )

    # one rank with the same global batch (2 x 4 rows) sees the same documents and learns as far
    rc, text = run_lmpipe(tmp_path, "one", "run", *COMMON, "--batch-size", "8", "--steps", "0", "--port", str(port),
                      "--summary-json", str(tmp_path / "one.json"))  # fmt: skip
    assert rc == 0, text[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert ddp["tokens"] == one["tokens"]
    assert abs(ddp["steps"] - one["steps"]) <= 2  # the ranks' shares end within a step or two of each other
    assert one["first_loss"] - one["last_loss"] > 1.0, "the model learns"
    # the same curve up to data order (the exact equality of one update is the test above)
    tail = [sum(run["losses"][-4:]) / 4 for run in (ddp, one)]
    assert abs(tail[0] - tail[1]) < 0.15 * tail[1], (ddp["losses"], one["losses"])


@pytest.mark.slow
def test_a_checkpoint_holds_every_ranks_cursors(tmp_path, port, tok):
    ck = tmp_path / "ck"
    args = [
        *COMMON,
        "--batch-size",
        "4",
        "--port",
        str(port),
        "--checkpoint-dir",
        str(ck),
        "--resume",
        "auto",
    ]
    rc, text = run_lmpipe(tmp_path, "first", "run", *args, "--steps", "12", "--checkpoint-every", "6",
                      "--doc-log", str(tmp_path / "a.jsonl"), nproc=2)  # fmt: skip
    assert rc == 0, text[-3000:]
    state = json.loads((ck / "step-00000012" / "header.json").read_text())
    assert state["stream"]["world_size"] == 2

    # (another world size resumes too, the shards shared anew: tests/e2e/test_resize.py)

    rc, text = run_lmpipe(tmp_path, "second", "run", *args, "--steps", "0", "--doc-log", str(tmp_path / "b.jsonl"),
                      nproc=2)  # fmt: skip
    assert rc == 0 and "resumed from" in text, text[-3000:]
    entries = [e for stem in ("a", "b") for p in rank_logs(tmp_path, stem) for e in doc_log_entries(p)]
    assert_exactly_once(doc_pieces(entries), builtin_lengths(tok, DOCS))


def test_bf16_gradient_reduction_on_cpu_is_one_clear_error(tmp_path, port):
    # torch's bf16 compression hook needs NCCL: on gloo it would fail inside DDP with a TypeError
    rc, text = run_lmpipe(tmp_path, "bf16", "run", "--device", "cpu", "--grad-reduce", "bf16", "--steps", "2",
                      "--port", str(port), "--metrics-port", "-1", nproc=2, timeout=120)  # fmt: skip
    assert rc != 0
    assert "--grad-reduce bf16 needs CUDA GPUs (NCCL)" in text
    assert "TypeError" not in text, text[-3000:]


@pytest.mark.parametrize("rank", [None, "1"])
def test_a_world_size_without_torchrun_is_refused_not_half_the_corpus(tmp_path, port, rank):
    """`lmpipe run --world-size 2` without torchrun trained rank 0's share of the corpus alone: 44 steps and
    74,981 tokens of a file whose whole was 91 steps and 168,373 tokens, without a word."""
    args = ["--world-size", "2", *(["--rank", rank] if rank else [])]
    rc, text = run_lmpipe(
        tmp_path, "run", "run", *COMMON, *args, "--steps", "2", "--port", str(port), timeout=120
    )
    assert rc == 2, text[-3000:]
    assert text.strip().splitlines() == [
        f"lmpipe run: --rank/--world-size {rank or 0}/2 name ranks of a torchrun job, and this trainer runs "
        "without torchrun (one rank): start it with `torchrun --nproc-per-node 2 -m lmpipe ...` and leave them "
        "out, or leave them out to train on the whole corpus here"
    ]
