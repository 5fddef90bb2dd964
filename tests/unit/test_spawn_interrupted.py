"""A Loader's start interrupted half-way through starting its producers (Ctrl-C, a failed start) leaves
none of those already started behind: no one else holds them, and they would wait for a trainer forever."""

from __future__ import annotations

import subprocess

import pytest

from lmpipe import procs
from lmpipe.shared.config import PipelineConfig


def test_producers_started_before_an_interrupt_are_killed(monkeypatch):
    real, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:  # Ctrl-C while starting the second producer
            raise KeyboardInterrupt
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(procs.subprocess, "Popen", popen)
    try:
        with pytest.raises(KeyboardInterrupt):
            procs.spawn_producers(PipelineConfig(producers=2), -1, "WARNING")
        assert started[0].poll() is not None, "the first producer was left running"
    finally:
        if started[0].poll() is None:
            started[0].kill()
            started[0].wait()
