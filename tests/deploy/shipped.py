"""The deployment files as shipped (compose, Dockerfiles, Grafana, Prometheus) and the Prometheus config
renderer, deploy/render_prometheus.py, loaded as a module (deploy/ is not a package)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.helpers import REPO

DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CPU = REPO / "docker-compose.cpu.yml"
COMPOSE_DEBIAN = REPO / "docker-compose.debian.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lmpipe.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "lmpipe.yml"
DOCKERFILES = {"producer": DEPLOY / "Dockerfile.producer", "trainer": DEPLOY / "Dockerfile.trainer"}
# Where no image registry answers: the Debian base image script and Prometheus from Debian's package
DEBIAN_BASE = DEPLOY / "debian" / "base.sh"
DOCKERFILE_PROMETHEUS = DEPLOY / "debian" / "Dockerfile.prometheus"
COMPOSE_SCHEMA = Path(__file__).resolve().parent.parent / "data" / "compose-spec.json"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_prometheus", DEPLOY / "render_prometheus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render_prometheus = _load_renderer()


def debian_image() -> str:
    """The local image deploy/debian/base.sh builds from Debian's archive (its default name)."""
    (name,) = re.findall(r"^image=\$\{LMPIPE_DEBIAN_IMAGE:-([^}]+)\}", DEBIAN_BASE.read_text(), re.M)
    return name
