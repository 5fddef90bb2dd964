"""Fixtures only: the built-in tokenizer, free ports, real lmpipe processes; the CUDA skip hook.

The helpers they are built on live in tests/helpers.py, which is where tests import them from.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from lmpipe.cli import OMP_WAIT_POLICY  # torch-free

# as lmpipe's own processes (cli.main): the in-process tests' torch threads sleep when idle instead of spinning
# beside the other xdist worker's processes; set before torch loads libgomp
os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)

import torch  # noqa: E402

from lmpipe.shared.tokenizer import load_tokenizer
from tests.helpers import PORTS_DIR, Procs, cli_in_process, free_port_pair

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


_ports_key = pytest.StashKey[str]()


def pytest_configure(config):
    """One folder of port reservations per session (helpers.free_ports), made by the process that starts
    the xdist workers, which inherit it."""
    if PORTS_DIR not in os.environ:
        os.environ[PORTS_DIR] = tempfile.mkdtemp(prefix="lmpipe-test-ports-")
        config.stash[_ports_key] = os.environ[PORTS_DIR]
    # A suite started in the background by a shell without job control (`nohup pytest &`, some CI runners)
    # inherits SIGINT ignored, and Python then leaves it ignored: the Ctrl-C tests' processes (and this one)
    # would never see theirs. Python's own handler, as a process started in a terminal has: a caught signal
    # is back to its default in every process started from here, which then installs the same.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    if where := config.stash.get(_ports_key, None):
        shutil.rmtree(where, ignore_errors=True)
        os.environ.pop(PORTS_DIR, None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report kept on the item (`rep_call`): a fixture's teardown can see if the test failed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture
def procs(tmp_path, request):
    ps = Procs(tmp_path)
    yield ps
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:  # a hang's stacks: every thread of every process still running
        ps.dump_stacks()
    ps.cleanup()


@pytest.fixture(autouse=True)
def _storage_waits_reach_no_earlier_producer(monkeypatch):
    """A producer built in-process hooks the process-wide storage waits (producer/remote.py's WAITS): a
    later test's retries must not sleep on, or be stopped by, an earlier test's producer."""
    from lmpipe.producer import remote

    monkeypatch.setattr(remote, "WAITS", remote.StorageWaits())
