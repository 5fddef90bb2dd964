"""docker-compose.yml and docker-compose.cpu.yml, checked statically (Docker cannot run on this project's
machines): the compose-spec schema, the scaling rules, the commands as lmpipe's own parser reads them.

tests/data/compose-spec.json is the Compose Specification's schema (Apache-2.0, compose-spec.LICENSE beside
it), as vendored in the check-jsonschema package (PyPI) 0.39.0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.shipped import (
    COMPOSE,
    COMPOSE_CPU,
    COMPOSE_DEBIAN,
    debian_image,
)
from tests.helpers import REPO


def test_podman_compose_reads_the_files_as_docker_compose_does():
    """podman-compose (>= 1.6, the dev extra) reads !reset, `scale` and ${VAR:-} defaults as Compose does;
    Debian's 1.0.3 does not (deploy/README.md)."""
    venv = str(Path(sys.executable).parent)  # the dev extra's podman-compose before Debian's
    pc = shutil.which("podman-compose", path=venv) or shutil.which("podman-compose")
    if pc is None or shutil.which("podman") is None:
        pytest.skip("no podman and podman-compose here")
    version = subprocess.run([pc, "version"], capture_output=True, text=True).stdout
    if "podman-compose version 1.0" in version:
        pytest.skip(f"{pc} is older than 1.6 (Debian's): pip install -e '.[dev]' brings a newer one")
    files = ["-f", str(COMPOSE), "-f", str(COMPOSE_CPU), "-f", str(COMPOSE_DEBIAN)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
    r = subprocess.run([pc, *files, "config"], capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert "deploy" not in services["trainer"], "the GPU reservation is reset"
    assert str(services["producer"]["scale"]) == "2"
    assert services["producer"]["environment"]["LMPIPE_DATA"] == "", "${LMPIPE_DATA:-} is empty"
    assert f"BASE_IMAGE={debian_image()}" in services["producer"]["build"]["args"]
    assert services["trainer"]["healthcheck"]["test"][0] == "CMD"


def test_docker_compose_config_accepts_the_files():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here (Docker cannot run on this project's machines)")
    for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(COMPOSE_CPU)]):
        r = subprocess.run(
            [docker, "compose", *files, "config", "--quiet"], capture_output=True, text=True, cwd=REPO
        )
        assert r.returncode == 0, r.stderr
