#!/usr/bin/env bash
# The compose stack in real containers: builds the images, brings up the CPU trainer, 2 then 3 producers and
# Prometheus with the engine found (Docker Compose v2, or podman with podman-compose), checks Prometheus's
# DNS discovery, the dashboard queries, the health checks, and a killed trainer coming back to finish its
# epoch exactly once; then tears it all down. What it checks and why: tests/deploy/compose_smoke.py.
#
#   deploy/compose-smoke.sh [--engine docker|podman] [--base public|debian] [--keep] [--help]
#
# Exit status: 0 passed, 1 failed, 77 skipped (no container engine can run containers here; it says why).
# Needs the dev install (python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'), run as root for podman.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
# podman-compose from the dev extra comes first
PATH="$(dirname "$python"):$PATH" exec "$python" -m tests.deploy.compose_smoke "$@"
