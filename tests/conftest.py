"""Fixtures only: the built-in tokenizer, free ports, real lmpipe processes; the CUDA skip hook.

The helpers they are built on live in tests/helpers.py, which is where tests import them from.
"""

from __future__ import annotations

import pytest
import torch

from lmpipe.shared.tokenizer import load_tokenizer
from tests.helpers import Procs, free_port_pair

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


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.cleanup()
