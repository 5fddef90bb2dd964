"""docker-compose.yml and docker-compose.cpu.yml, checked statically (Docker cannot run on this project's
machines): the compose-spec schema, the scaling rules, the commands as lmpipe's own parser reads them.

tests/data/compose-spec.json is the Compose Specification's schema (Apache-2.0, compose-spec.LICENSE beside
it), as vendored in the check-jsonschema package (PyPI) 0.39.0.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from lmpipe.cli import build_parser
from lmpipe.options import HealthOptions
from lmpipe.shared.settings import from_args
from tests.deploy.compose import interpolate, load_compose, merge_compose, plain, service_argv, service_env
from tests.deploy.shipped import (
    COMPOSE,
    COMPOSE_CPU,
    COMPOSE_DEBIAN,
    COMPOSE_SCHEMA,
    DOCKERFILE_PROMETHEUS,
    DOCKERFILES,
    debian_image,
    render_prometheus,
)
from tests.helpers import REPO


def test_compose_files_validate_against_the_compose_spec():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in (COMPOSE, COMPOSE_CPU, COMPOSE_DEBIAN):
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(plain(load_compose(path)))
        ]
        assert not errors, f"{path.name}: {errors}"
    bad = plain(load_compose(COMPOSE))
    bad["services"]["producer"]["replicas"] = 2  # belongs under deploy:
    assert list(validator.iter_errors(bad)), "the schema is checking for real"


def test_compose_follows_the_scaling_rules():
    doc = load_compose(COMPOSE)
    services = doc["services"]
    assert set(services) == {"producer", "trainer", "prometheus", "grafana"}
    producer, trainer = services["producer"], services["trainer"]
    # scalable: no fixed name, no host port, no per-replica worker id
    assert "container_name" not in producer and "ports" not in producer
    # elastic: the trainer splits the corpus into its own --shards, so the number of replicas is
    # `--scale producer=N` alone (LMPIPE_PRODUCERS only sets how many start), with nothing to keep in step
    assert (
        interpolate(producer["scale"], {}) == "2"
        and interpolate(producer["scale"], {"LMPIPE_PRODUCERS": "3"}) == "3"
    )
    for svc in (producer, trainer):
        assert "LMPIPE_PRODUCERS" not in service_env(svc), "no split to keep in step with the replicas"
    assert "${LMPIPE_SHARDS:-" in str(trainer["environment"]["LMPIPE_SHARDS"])
    assert service_argv(producer)[:2] == ["lmpipe", "produce"]
    assert service_argv(trainer)[:2] == ["lmpipe", "train"]
    pargv = service_argv(producer)
    assert pargv[pargv.index("--worker") + 1] == "-1"
    assert "LMPIPE_WORKER" not in service_env(producer)
    targv = service_argv(trainer)
    for argv in (pargv, targv):  # data and control through Unix sockets in a shared volume, no tcp port
        assert "--host" not in argv and "--trusted-network" not in argv
        assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0", "Prometheus scrapes across containers"
    assert "ports" not in trainer
    run_dir = service_env(trainer)["LMPIPE_RUNTIME_DIR"]
    assert service_env(producer)["LMPIPE_RUNTIME_DIR"] == run_dir
    for svc in (producer, trainer):
        assert f"lmpipe-run:{run_dir}" in svc["volumes"]
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert trainer.get("shm_size")
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
    # one named volume for data and checkpoints, shared by the trainer and every producer
    assert "lmpipe-data" in doc["volumes"]
    for svc in (producer, trainer):
        assert "lmpipe-data:/data" in svc["volumes"]
    # the corpus and the strategy come from the environment, with defaults
    for svc in (producer, trainer):
        for var in ("LMPIPE_DATA", "LMPIPE_STRATEGY"):
            assert f"${{{var}:-" in str(svc["environment"][var]), var
    # Grafana is published for the user, Prometheus reads the shipped config
    assert any(str(p).endswith(":3000:3000") for p in services["grafana"]["ports"])
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (REPO / prom_mounts["/etc/prometheus/prometheus.yml"]).resolve() == render_prometheus.SHIPPED


def test_a_killed_trainer_or_producer_comes_back_and_a_finished_one_stays_down():
    """on-failure: a crash, an OOM kill or a SIGKILL restarts the container (the trainer resumes from its
    checkpoint in the shared volume; deploy/compose-smoke.sh checks it for real); a run that finished or was
    stopped (exit 0) is not started again, and a failure that repeats gives up after a few tries."""
    services = load_compose(COMPOSE)["services"]
    for name in ("trainer", "producer"):
        m = re.fullmatch(r"on-failure:(\d+)", services[name].get("restart", ""))
        assert m and 1 <= int(m[1]) <= 10, f"{name}: restart {services[name].get('restart')!r}"
    trainer_env = service_env(services["trainer"])
    assert trainer_env["LMPIPE_RESUME"] == "auto" and trainer_env["LMPIPE_CHECKPOINT_DIR"].startswith(
        "/data/"
    )


def test_debian_override_builds_every_image_here_from_debian_packages():
    """docker-compose.debian.yml, for hosts that reach Debian's archive and the package index but no image
    registry: both images on the Debian base (BASE_IMAGE, torch from the package index) and Prometheus from
    Debian's package; nothing else changes."""
    override = load_compose(COMPOSE_DEBIAN)
    assert {k for svc in override["services"].values() for k in svc} <= {"build", "image"}
    merged = merge_compose(merge_compose(load_compose(COMPOSE), load_compose(COMPOSE_CPU)), override)
    services = merged["services"]
    for name in ("producer", "trainer"):
        args = services[name]["build"]["args"]
        assert args == {"BASE_IMAGE": debian_image(), "TORCH_INDEX": ""}, name
        declared = set(re.findall(r"^ARG (\w+)", DOCKERFILES[name].read_text(), re.M))
        assert set(args) <= declared
    prom = services["prometheus"]
    assert (REPO / prom["build"]["context"] / prom["build"]["dockerfile"]) == DOCKERFILE_PROMETHEUS
    assert not prom["image"].startswith("prom/"), "a local name, not the registry's"
    assert (
        "deploy" not in services["trainer"] and services["trainer"]["environment"]["LMPIPE_DEVICE"] == "cpu"
    )


def _parse_compose_command(svc: dict, monkeypatch):
    from lmpipe.cli import build_parser

    for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
        monkeypatch.delenv(k)
    for k, v in service_env(svc).items():
        monkeypatch.setenv(k, v)
    argv = service_argv(svc)
    assert argv[0] == "lmpipe"
    return build_parser().parse_args(argv[1:])  # lmpipe's own parser reads LMPIPE_* defaults at build time


def test_compose_commands_are_valid_lmpipe_commands_that_agree(monkeypatch):
    from lmpipe.shared.config import pipeline_from_args

    services = load_compose(COMPOSE)["services"]
    prod_ns = _parse_compose_command(services["producer"], monkeypatch)
    train_ns = _parse_compose_command(services["trainer"], monkeypatch)
    assert (prod_ns.cmd, train_ns.cmd) == ("produce", "train")
    prod, train = pipeline_from_args(prod_ns), pipeline_from_args(train_ns)
    assert prod.stream_fields() == train.stream_fields(), "the handshake would refuse the producers"
    assert (prod.data, prod.tokenizer) == (train.data, train.tokenizer)
    assert prod.port == train.port and prod.runtime_dir == train.runtime_dir
    assert not (prod.trusted_network or train.trusted_network or prod.curve_dir)
    assert prod_ns.worker == -1
    # the ports Prometheus scrapes and the health checks probe are the ones the processes serve
    assert f"trainer:{train_ns.metrics_port}" == render_prometheus.COMPOSE_TRAINER
    assert prod_ns.metrics_port == render_prometheus.COMPOSE_PRODUCER_PORT
    for name, ns in (("trainer", train_ns), ("producer", prod_ns)):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "lmpipe", "health"], test
        assert from_args(build_parser().parse_args(test[2:]), HealthOptions).metrics_port == ns.metrics_port
    assert prod_ns.metrics_linger > 0 and train_ns.metrics_linger > 0, "a last scrape after the work"


def test_cpu_override_drops_the_gpu_and_builds_the_cpu_variant(monkeypatch):
    merged = merge_compose(load_compose(COMPOSE), load_compose(COMPOSE_CPU))
    trainer = merged["services"]["trainer"]
    assert "deploy" not in trainer, "no GPU reservation left"
    args = trainer["build"]["args"]
    assert "cuda" not in args["BASE_IMAGE"] and args["TORCH_INDEX"].endswith("/cpu")
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILES["trainer"].read_text(), re.M))
    assert set(args) <= declared, "build args the Dockerfile declares"
    assert trainer["image"] != load_compose(COMPOSE)["services"]["trainer"]["image"], (
        "no clash with the GPU image"
    )
    assert trainer["environment"]["LMPIPE_DEVICE"] == "cpu"
    assert service_argv(trainer)[:2] == ["lmpipe", "train"], "the same command"
    ns = _parse_compose_command(trainer, monkeypatch)
    assert ns.device == "cpu"
