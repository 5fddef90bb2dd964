"""torch is an extra: a producer-only host (no torch) runs `lmpipe produce` against a trainer elsewhere, and
the trainer's commands there say in one line how to add it. "No torch" is a process in which `import torch`
fails, as where it is not installed (a sitecustomize that blocks it)."""

from __future__ import annotations

import tomllib

from tests.helpers import REPO


def test_torch_is_the_train_extra_not_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("torch")]
    assert [d for d in project["optional-dependencies"]["train"] if d.startswith("torch")]
