"""Issue 42, a warm restart's start: the checkpoint to resume is read (checksum, torch.load) on a thread of its
own while the model is built, and load() takes that read only after the header's checks, exactly as a read
of its own (in-process: real checkpoints written by CheckpointManager)."""

from __future__ import annotations

import threading

import pytest
import torch

from lmpipe.consumer import checkpoint
from lmpipe.consumer.checkpoint import CheckpointError, CheckpointManager, ReadAhead, load, read_header
from tests.helpers import tiny_model

HEADER = {"model": "m"}


def saved(tmp_path, step: int = 3):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sum((p**2).sum() for p in model.parameters()).backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "workers": [[]],
             "rng": {"torch": torch.get_rng_state()}}  # fmt: skip
    return CheckpointManager(tmp_path).save(step, HEADER, state)


def test_the_state_is_read_on_a_thread_of_its_own_before_load_asks_for_it(tmp_path, monkeypatch):
    ck = saved(tmp_path)
    read_by: list[str] = []
    done = threading.Event()
    real = checkpoint._read_state

    def recording(path, header):
        read_by.append(threading.current_thread().name)
        out = real(path, header)
        done.set()
        return out

    monkeypatch.setattr(checkpoint, "_read_state", recording)
    ahead = ReadAhead(ck, read_header(ck))
    assert done.wait(30), "the read did not run until load() asked for it"
    got = load(ck, HEADER, ahead)
    assert read_by == ["checkpoint-read"], "read once, on its own thread, not again by load()"
    plain = load(ck, HEADER)  # a read of its own: the same state
    assert got.state["step"] == plain.state["step"] == 3
    for k, v in plain.state["model"].items():
        assert torch.equal(got.state["model"][k], v), k


def test_a_damaged_state_read_ahead_is_refused_at_load_with_its_line(tmp_path):
    ck = saved(tmp_path)
    raw = bytearray((ck / "state.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (ck / "state.pt").write_bytes(bytes(raw))
    ahead = ReadAhead(ck, read_header(ck))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(ck, HEADER, ahead)


def test_the_header_is_checked_first_whatever_the_read_ahead_found(tmp_path):
    """A checkpoint of another run is refused for what differs, as before the read went ahead, even where its
    state is damaged too (the read's error is never the one said)."""
    ck = saved(tmp_path)
    (ck / "state.pt").write_bytes(b"not a state")
    ahead = ReadAhead(ck, read_header(ck))
    with pytest.raises(CheckpointError) as refused:
        load(ck, {"model": "another"}, ahead)
    assert "model" in str(refused.value) and "checksum" not in str(refused.value)
