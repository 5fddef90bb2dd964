"""A Loader's start interrupted half-way (Ctrl-C, a failed start) leaves none of its processes behind: the
zygote and the producers it forked already hold no one else, and would wait for a trainer forever."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmpipe import Loader, zygote
from tests.helpers import free_ports


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_processes_started_before_an_interrupt_are_stopped(monkeypatch):
    real, seen = zygote.Zygote.wait_started, []

    def interrupted(self):
        seen.extend([self.pid, *real(self)])  # Ctrl-C once the producers are forked
        raise KeyboardInterrupt

    monkeypatch.setattr(zygote.Zygote, "wait_started", interrupted)
    loader = Loader(seq_len=32, batch_size=2, producers=2, shards=2, builtin_docs=20, device="cpu",
                    port=free_ports(2))  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        loader.start()
    assert len(seen) == 3 and all(gone(pid) for pid in seen), "the zygote or a producer was left running"
