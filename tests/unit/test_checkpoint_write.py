"""Issue 43, the write's cost: state.pt is written in one pass (no zip CRC32s, its blocks' sha256s computed
while it is written, never read back), and checkpoints written the way before (format 3: one sha256 of the
whole file, CRC32s) still load (in-process: real models, optimizers, files)."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import pytest
import torch

from lmpipe.consumer import checkpoint
from lmpipe.consumer.checkpoint import FORMAT_VERSION, CheckpointError, CheckpointManager, load
from lmpipe.consumer.checkpoint_async import CheckpointWriter, HostSnapshot
from lmpipe.shared import __version__
from lmpipe.shared.files import sha256_file
from lmpipe.shared.metrics import TrainerMetrics
from tests.helpers import tiny_model

CPU = torch.device("cpu")


def trained(device: torch.device = CPU):
    model = tiny_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=device.type == "cuda")
    train_step(model, opt)
    return model, opt


def train_step(model, opt) -> None:
    """An update of every weight and of AdamW's moments."""
    sum((p.float() ** 2).sum() for p in model.parameters()).backward()
    opt.step()
    opt.zero_grad()


def cursors() -> list[list[dict]]:
    return [[{"cursor": {"epoch": 0, "pos": 4, "offset": 5, "skip": 0}, "last_seq": 7, "finished": False}]]


def live_state(model, opt, workers) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3, "workers": workers,
            "rng": {"torch": torch.get_rng_state()}}  # fmt: skip


def frozen(state) -> dict:
    """What `state`'s tensors hold now, cloned to the host (the expectation)."""
    return {"model": {k: v.cpu().clone() for k, v in state["model"].items()},
            "exp_avg": {k: s["exp_avg"].cpu().clone() for k, s in state["optimizer"]["state"].items()},
            "workers": json.loads(json.dumps(state["workers"]))}  # fmt: skip


def assert_holds(snap, expected) -> None:
    for k, v in expected["model"].items():
        assert torch.equal(snap["model"][k], v), k
    for k, v in expected["exp_avg"].items():
        assert torch.equal(snap["optimizer"]["state"][k]["exp_avg"], v), k
    assert snap["workers"] == expected["workers"]


HEADER = {"model": "m"}


def state_with_a_large_tensor() -> dict:
    """A trained state, with a tensor of 2 MiB: written in one write large enough for the hash thread."""
    model, opt = trained()
    return {**live_state(model, opt, cursors()), "extra": torch.arange(1 << 19, dtype=torch.float32)}


def old_save(folder: Path, step: int, state: dict) -> Path:
    """A checkpoint as lmpipe wrote it before the one-pass write (format 3): torch.save with its zip CRC32s
    (torch's default), fsync, and the header's sha256 of the whole file, read back from it."""
    ck = folder / f"step-{step:08d}"
    ck.mkdir(parents=True, mode=0o755)
    with open(ck / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    header = {**HEADER, "format_version": 3, "lmpipe_version": __version__, "step": step,
              "state_sha256": sha256_file(ck / "state.pt"), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    (ck / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    (folder / "latest").write_text(ck.name + "\n")
    return ck


def test_a_checkpoint_written_before_the_one_pass_write_still_loads(tmp_path):
    state = state_with_a_large_tensor()
    expected = frozen(state)
    old = old_save(tmp_path, 4, state)
    assert any(i.CRC for i in zipfile.ZipFile(old / "state.pt").infolist()), "written with CRC32s, as before"
    assert CheckpointManager(tmp_path).latest() == old
    ck = load(old, HEADER)
    assert_holds(ck.state, expected)
    assert torch.equal(ck.state["extra"], state["extra"])


def test_the_header_holds_the_sha256_of_the_file_written_without_crcs_or_a_read_back(tmp_path, monkeypatch):
    def no_read_back(path):
        raise AssertionError(f"{path} read back to hash it")

    monkeypatch.setattr(checkpoint, "sha256_file", no_read_back)  # the writer must hash as it writes
    state = state_with_a_large_tensor()
    expected = frozen(state)
    manager = CheckpointManager(tmp_path)
    ck = manager.save(5, HEADER, state)
    monkeypatch.undo()
    header = json.loads((ck / "header.json").read_text())
    assert header["format_version"] == FORMAT_VERSION == 4 and "state_sha256" not in header
    assert header["state_sha256_blocks"] == {"block_bytes": 2 << 20, "sha256": blocks_digest(ck / "state.pt")}
    assert manager.last_parts["bytes"] == (ck / "state.pt").stat().st_size
    assert all(i.CRC == 0 for i in zipfile.ZipFile(ck / "state.pt").infolist()), "no zip CRC32s"
    assert torch.serialization.get_crc32_options(), "torch.save's CRC option is restored after the write"
    loaded = load(ck, HEADER)
    assert_holds(loaded.state, expected)
    assert torch.equal(loaded.state["extra"], state["extra"])


def blocks_digest(path: Path, block: int = 2 << 20) -> str:
    """The sha256 of the sha256s of each `block` bytes, computed here the plain way."""
    data = path.read_bytes()
    return hashlib.sha256(b"".join(hashlib.sha256(data[i : i + block]).digest()
                                   for i in range(0, len(data), block))).hexdigest()  # fmt: skip


@pytest.mark.parametrize("damage", ["a byte changed", "truncated", "a byte added", "another block size"])
def test_a_damaged_state_written_without_crcs_is_refused_by_its_block_sha256s(tmp_path, damage):
    ck = CheckpointManager(tmp_path).save(6, HEADER, state_with_a_large_tensor())
    raw = bytearray((ck / "state.pt").read_bytes())
    if damage == "a byte changed":
        raw[len(raw) // 2] ^= 0x01  # in the tensors' data, where no CRC would notice it
    elif damage == "truncated":
        raw = raw[: 2 << 20]  # whole blocks: only the missing ones can tell
    elif damage == "a byte added":
        raw += b"\0"
    else:
        header = json.loads((ck / "header.json").read_text())
        header["state_sha256_blocks"]["block_bytes"] = 1 << 20
        (ck / "header.json").write_text(json.dumps(header))
    (ck / "state.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(ck, HEADER)


def test_each_checkpoint_says_where_the_step_loop_stop_went(tmp_path):
    model, opt = trained()
    for mode in ("sync", "async"):
        writer = CheckpointWriter(CheckpointManager(tmp_path / mode), mode, CPU, TrainerMetrics())
        blocked = writer.save(1, HEADER, live_state(model, opt, cursors()))
        writer.finish("test")
        assert set(writer.last_stop) == ({"wait", "copy", "write"} if mode == "sync" else {"wait", "copy"})
        assert sum(writer.last_stop.values()) == pytest.approx(blocked, abs=0.05)
        assert writer.manager.last_parts["total"] > 0


@pytest.mark.cuda
def test_a_cuda_snapshot_says_how_long_its_copy_took_on_the_device():
    cuda = torch.device("cuda")
    model, opt = trained(device=cuda)
    workers = cursors()
    train_step(model, opt)  # queued, not waited for
    state = live_state(model, opt, workers)
    snapper = HostSnapshot(cuda)
    snap = snapper.take(state)
    expected = frozen(state)
    assert 0 < snapper.copy_seconds < 5
    train_step(model, opt)
    torch.cuda.synchronize()
    assert_holds(snap, expected)
