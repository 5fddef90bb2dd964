"""Issue 43: an asynchronous checkpoint holds the state of the step it was taken at, whatever training does
after (in-process: a real model, optimizer and checkpoint folder; the real-process guarantees are in
tests/e2e/test_checkpoint_async.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from lmpipe.consumer.checkpoint import TEST_WRITE_DELAY, CheckpointManager, load
from lmpipe.consumer.checkpoint_async import CheckpointWriter, HostSnapshot, resolve_mode
from lmpipe.shared.metrics import TrainerMetrics
from tests.helpers import tiny_model

CPU = torch.device("cpu")


def trained(steps: int = 1, device: torch.device = CPU):
    model = tiny_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device.type == "cuda")
    for _ in range(steps):
        train_step(model, opt)
    return model, opt


def train_step(model, opt) -> None:
    """An update of every weight and of AdamW's moments (the loss: the weights' squares)."""
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    opt.step()
    opt.zero_grad()


def live_state(model, opt, cursors) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3, "workers": cursors,
            "rng": {"torch": torch.get_rng_state()}}  # fmt: skip


def frozen(state) -> dict:
    """What `state` holds now, cloned (the expectation)."""
    return {
        "model": {k: v.cpu().clone() for k, v in state["model"].items()},
        "exp_avg": {k: s["exp_avg"].cpu().clone() for k, s in state["optimizer"]["state"].items()},
        "lr": state["optimizer"]["param_groups"][0]["lr"],
        "workers": [[dict(w, cursor=dict(w["cursor"])) for w in rank] for rank in state["workers"]],
    }


def assert_holds(snap, expected) -> None:
    for k, v in expected["model"].items():
        assert torch.equal(snap["model"][k], v), k
    for k, v in expected["exp_avg"].items():
        assert torch.equal(snap["optimizer"]["state"][k]["exp_avg"], v), k
    assert snap["optimizer"]["param_groups"][0]["lr"] == expected["lr"]
    assert snap["workers"] == expected["workers"]


def cursors() -> list[list[dict]]:
    return [[{"cursor": {"epoch": 0, "pos": 4, "offset": 5, "skip": 0}, "last_seq": 7, "finished": False}]]


def train_on_and_consume(model, opt, workers) -> None:
    """What the step loop does after a snapshot: more steps, a new learning rate, more batches consumed."""
    for _ in range(2):
        train_step(model, opt)
    opt.param_groups[0]["lr"] = 0.5
    workers[0][0]["cursor"]["pos"] = 99
    workers[0][0]["last_seq"] = 42


def test_a_snapshot_is_not_changed_by_later_steps_and_reuses_its_buffers():
    model, opt = trained()
    workers = cursors()
    state = live_state(model, opt, workers)
    expected = frozen(state)
    snapper = HostSnapshot(CPU)
    snap = snapper.take(state)
    train_on_and_consume(model, opt, workers)
    assert not torch.equal(model.state_dict()["lm_head.weight"], expected["model"]["lm_head.weight"])
    assert_holds(snap, expected)
    # tied weights stay tied in the copy (state.pt holds them once, as a synchronous checkpoint's)
    assert snap["model"]["lm_head.weight"] is snap["model"]["transformer.wte.weight"]
    # the next snapshot refills the same host memory: allocated once
    size = snapper.nbytes
    again = snapper.take(live_state(model, opt, workers))
    assert snapper.nbytes == size
    assert again["model"]["lm_head.weight"].data_ptr() == snap["model"]["lm_head.weight"].data_ptr()


@pytest.mark.cuda
def test_a_cuda_snapshot_waits_for_the_queued_step_and_lands_in_pinned_memory():
    cuda = torch.device("cuda")
    model, opt = trained(device=cuda)
    workers = cursors()
    train_step(model, opt)  # queued on the GPU, not waited for: the snapshot must copy what it leaves
    state = live_state(model, opt, workers)
    snapper = HostSnapshot(cuda)
    snap = snapper.take(state)
    torch.cuda.synchronize()
    expected = frozen(state)
    train_on_and_consume(model, opt, workers)
    torch.cuda.synchronize()
    assert_holds(snap, expected)
    assert all(b.is_pinned() for b in snapper._buffers.values())
    assert snap["model"]["lm_head.weight"].device.type == "cpu"


def test_a_background_write_holds_the_snapshotted_step_not_what_training_did_meanwhile(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_WRITE_DELAY, "0.5")  # the write is still running while training goes on
    model, opt = trained()
    workers = cursors()
    state = live_state(model, opt, workers)
    expected = frozen(state)
    writer = CheckpointWriter(CheckpointManager(tmp_path), "async", CPU, TrainerMetrics())
    writer.save(3, {"model": "m"}, state)
    assert writer.in_flight == 3
    train_on_and_consume(model, opt, workers)
    writer.finish("test")
    ck = load(tmp_path / "step-00000003", {"model": "m"})
    assert_holds(ck.state, expected)
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"


def test_a_checkpoint_due_during_a_write_says_so_and_waits(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(TEST_WRITE_DELAY, "0.3")
    model, opt = trained()
    writer = CheckpointWriter(CheckpointManager(tmp_path, keep=5), "async", CPU, TrainerMetrics())
    with caplog.at_level(logging.INFO, logger="lmpipe.trainer"):
        writer.save(1, {}, live_state(model, opt, cursors()))
        writer.save(2, {}, live_state(model, opt, cursors()))  # the write of step 1 is still sleeping
        writer.finish("training finished")
    said = [r.getMessage() for r in caplog.records]
    assert sum("checkpoint step 2 is due while the write of step 1 is still running" in m for m in said) == 1
    assert any(m.startswith("training finished: waiting for the checkpoint write of step 2") for m in said)
    assert [p.name for p in CheckpointManager(tmp_path).list()] == ["step-00000001", "step-00000002"]


def test_a_failed_background_write_is_raised_in_the_step_loop_once(tmp_path):
    model, opt = trained()
    (tmp_path / "ck").write_text("a file where the checkpoint folder should be")
    writer = CheckpointWriter(CheckpointManager(tmp_path / "ck"), "async", CPU, TrainerMetrics())
    writer.save(1, {}, live_state(model, opt, cursors()))
    with pytest.raises(OSError, match="ck"):
        writer.finish("training finished")
    writer.check()  # said once: not raised again


def test_auto_is_async_on_cuda_and_sync_elsewhere():
    assert resolve_mode("auto", torch.device("cuda", 0)) == "async"
    assert resolve_mode("auto", CPU) == "sync"
    assert resolve_mode("async", CPU) == "async" and resolve_mode("sync", torch.device("cuda", 0)) == "sync"
