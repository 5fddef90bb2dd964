"""Shared fixtures: the built-in tokenizer, free ports, a way to start real lmpipe processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.common import free_port_pair
from lmpipe.shared.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture
def port() -> int:
    return free_port_pair()


def lmpipe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


class Procs:
    """Real lmpipe processes started by a test; all are killed (group and all) at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, name: str = "proc", env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        p = subprocess.Popen(
            [sys.executable, "-m", "lmpipe", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or lmpipe_env(),
            cwd=REPO,
            start_new_session=True,
        )
        p.log_path = self.tmp / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def log(self, p: subprocess.Popen) -> str:
        return Path(p.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def wait_for(self, p: subprocess.Popen, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(p):
                return
            if p.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not seen in {p.args} (rc={p.poll()}):\n{self.log(p)[-3000:]}")

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.cleanup()
