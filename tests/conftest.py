"""Fixtures only: the built-in tokenizer, free ports, real lmpipe processes; the CUDA skip hook.

The helpers they are built on live in tests/helpers.py, which is where tests import them from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmpipe.shared.tokenizer import load_tokenizer
from tests.helpers import Procs, cli_in_process, free_port_pair

torch.set_num_threads(2)


E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config, items):
    for item in items:  # the end-to-end tier is the slow one: `-m "not slow"` is tests/unit
        if E2E in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)
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


@pytest.fixture
def lmpipe_cli(monkeypatch, capsys):
    """`lmpipe ARGS` run in this process (lmpipe.cli.main, as the console script), with only `env` of
    LMPIPE_ variables: a namespace of returncode, stdout and stderr."""
    from types import SimpleNamespace

    from lmpipe import cli

    def run(*args: str, env: dict[str, str] | None = None) -> SimpleNamespace:
        capsys.readouterr()
        with cli_in_process(monkeypatch, env):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse: a usage mistake (2) or --help (0)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.cleanup()


@pytest.fixture(autouse=True)
def _storage_waits_reach_no_earlier_producer(monkeypatch):
    """A producer built in-process hooks the process-wide storage waits (producer/remote.py's WAITS): a
    later test's retries must not sleep on, or be stopped by, an earlier test's producer."""
    from lmpipe.producer import remote

    monkeypatch.setattr(remote, "WAITS", remote.StorageWaits())
