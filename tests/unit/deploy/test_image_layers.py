"""The images' layers: what a rebuild after a code change adds and leaves behind (deploy/README.md, "Operating
the stack under podman-compose")."""

from __future__ import annotations

from tests.deploy.dockerfile import instructions as _instructions
from tests.deploy.shipped import DOCKERFILES


def test_a_code_change_rebuilds_only_a_small_layer():
    """torch and lmpipe's dependencies are installed before lmpipe's code is copied, from pyproject.toml
    alone, and reach the runtime stage in their own layer: a rebuild after a code change (or a README edit)
    reuses that layer (about 1 GB in the CPU trainer) and adds a few MB, so the image it replaces, left
    untagged, holds no second copy of torch."""
    ins = _instructions(DOCKERFILES["trainer"])
    build = ins[: next(i for i, (op, rest) in enumerate(ins) if op == "FROM" and rest.endswith("AS lmpipe"))]
    copied = [src for op, rest in build if op == "COPY" for src in rest.split()[:-1]]
    assert copied == ["pyproject.toml"], "the build stage sees neither lmpipe/ nor README.md"
    assert any("pip install -r" in rest for op, rest in build if op == "RUN"), "the dependencies, there"
    (staged,) = [rest for op, rest in ins if op == "RUN" and "--root /staging" in rest]
    assert "--no-deps" in staged
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM") :]
    labels = [rest for op, rest in final if op == "LABEL"]
    assert labels == ["io.lmpipe.image=trainer"], "deploy/podman/compose.sh prunes replaced images by it"
