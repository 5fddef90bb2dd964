"""The Dockerfiles, checked statically: hadolint, pinned bases, stages, user, health check, what is copied."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.deploy.compose import load_compose
from tests.deploy.dockerfile import instructions as _instructions
from tests.deploy.shipped import COMPOSE, DOCKERFILE_PROMETHEUS, DOCKERFILES, debian_image
from tests.helpers import REPO


@pytest.mark.parametrize("role", sorted(DOCKERFILES))
def test_dockerfile_structure(role):
    ins = _instructions(DOCKERFILES[role])
    args = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args.setdefault(k, v)
    stages = []
    for op, rest in ins:
        if op == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], image)
            earlier, _ = list(stages), stages.append(rest.split()[-1] if " AS " in rest.upper() else None)
            if image in earlier:
                continue  # on an earlier stage of this file
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, f"unpinned base image {image}"
    assert len(stages) >= 2, "a build stage and a runtime stage"
    final = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM") :]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as a non-root user"
    health = [rest for op, rest in final if op == "HEALTHCHECK"]
    port = {"producer": 9401, "trainer": 9400}[role]
    # `lmpipe health`: the trainer must also be stepping (tests/e2e/deploy/test_health.py)
    assert health and f'lmpipe health --metrics-port \\"${{LMPIPE_METRICS_PORT:-{port}}}\\"' in health[0]
    assert not [rest for op, rest in ins if op == "ADD"], "COPY, not ADD (no remote URLs, no tar magic)"
    (entry,) = [json.loads(rest) for op, rest in final if op == "ENTRYPOINT"]
    assert entry == ["lmpipe", {"producer": "produce", "trainer": "train"}[role]]

    # everything COPY'd from the context passes .dockerignore (an allowlist), and every package is copied
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    ignore = [ln for ln in ignore if ln and not ln.startswith("#")]
    assert ignore[0] == "*", ".dockerignore starts by excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copied = set()
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            *srcs, _dest = rest.split()
            for src in srcs:
                assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
                assert (REPO / src).exists(), src
                copied.add(src.rstrip("/"))
    # lmpipe/ holds producer/, consumer/ and shared/ (the top-level names are links to them)
    assert "lmpipe" in copied, "lmpipe/ is not copied into the image"
    assert {"pyproject.toml", "README.md"} <= copied


def _base_arg(ins: list[tuple[str, str]]) -> str:
    first = next(i for i, (op, _) in enumerate(ins) if op == "FROM")
    head = [rest for op, rest in ins[:first] if op == "ARG"]
    assert [a.partition("=")[0] for a in head] == ["BASE_IMAGE"], "BASE_IMAGE is the only global argument"
    stages = {rest.split()[-1] for op, rest in ins if op == "FROM" and " AS " in rest}
    assert {rest.split()[0] for op, rest in ins if op == "FROM"} - stages == {"${BASE_IMAGE}"}, (
        "every stage on it"
    )
    return head[0].partition("=")[2]


def test_one_build_argument_picks_the_base_of_both_images():
    """BASE_IMAGE: the usual public images by default (unchanged for Docker users); where no registry answers,
    the Debian base built from Debian's archive (docker-compose.debian.yml passes it to both)."""
    defaults = {role: _base_arg(_instructions(path)) for role, path in DOCKERFILES.items()}
    assert defaults["producer"].startswith("python:3.12") and "slim" in defaults["producer"]
    assert defaults["trainer"].startswith("nvidia/cuda:"), "the GPU image by default"
    assert _base_arg(_instructions(DOCKERFILE_PROMETHEUS)) == debian_image()


def _shared_part(path: Path) -> list[tuple[str, str]]:
    ins = _instructions(path)
    start = next(i for i, (op, _) in enumerate(ins) if op == "FROM")
    # to the compile of lmpipe in the runtime stage, after its copy of /opt/venv and of lmpipe
    end = next(i for i, (op, rest) in enumerate(ins) if op == "RUN" and "compileall" in rest)
    # only the defaults of the torch arguments differ: none in the producer, PyPI's build in the trainer
    return [(op, _arg_name(rest) if op == "ARG" else rest) for op, rest in ins[start : end + 1]]


def _arg_name(rest: str) -> str:
    return rest.partition("=")[0]


def _arg_default(path: Path, name: str) -> str:
    (default,) = [
        rest.partition("=")[2] for op, rest in _instructions(path) if op == "ARG" and _arg_name(rest) == name
    ]
    return default


def test_producer_and_trainer_share_their_layers_on_one_base():
    """The build stage and the runtime stage up to its copy of /opt/venv are the same instructions in both
    Dockerfiles, but for the torch arguments' defaults: built on one base (the Debian one), the second image
    reuses the first's layers up to torch, which only the trainer has (the producer never imports it)."""
    producer, trainer = (_shared_part(DOCKERFILES[r]) for r in ("producer", "trainer"))
    assert producer == trainer
    assert any("pip install" in rest and "torch==" in rest for _, rest in producer)
    assert _arg_default(DOCKERFILES["producer"], "TORCH_VERSION") == "", "no torch in the producer image"
    assert _arg_default(DOCKERFILES["trainer"], "TORCH_VERSION") == "2.13.0", "what CI uses (.ci/run)"
    copies = [rest for op, rest in producer if op == "COPY" and rest.startswith("--from=")]
    assert copies == ["--from=build /opt/venv /opt/venv", "--from=lmpipe /staging/opt/venv /opt/venv"]
    # pip's downloads stay in a build cache mount, never in a layer
    pip = [rest for op, rest in producer if op == "RUN" and "pip install" in rest]
    assert len(pip) == 3, "torch, the dependencies, lmpipe"
    assert pip and all(rest.startswith("--mount=type=cache,target=/root/.cache/pip") for rest in pip)


def test_debian_prometheus_image_runs_like_the_prom_prometheus_image():
    """docker-compose.debian.yml swaps prom/prometheus for Debian's package: the compose service's mounts,
    default command and health check must work unchanged on it."""
    ins = _instructions(DOCKERFILE_PROMETHEUS)
    prom = load_compose(COMPOSE)["services"]["prometheus"]
    mounts = {v.split(":")[1] for v in prom["volumes"]}
    (entry,) = [json.loads(rest) for op, rest in ins if op == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for op, rest in ins if op == "CMD"]
    flags = dict(a.split("=", 1) for a in cmd)
    assert entry == ["/usr/bin/prometheus"] and "command" not in prom
    assert flags["--config.file"] in mounts and flags["--storage.tsdb.path"] in mounts
    (install,) = [rest for op, rest in ins if op == "RUN" and "apt-get install" in rest]
    assert "prometheus" in install.split() and prom["healthcheck"]["test"][1] in install.split()
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
