"""The CPU trainer's checkpoint interval is sized by time (docker-compose.cpu.yml): a crash of a CPU run loses
minutes at most, not the half hour 500 steps of the `small` model take on 2 cores."""

from __future__ import annotations

from tests.deploy.compose import interpolate, load_compose, merge_compose, service_env
from tests.deploy.shipped import COMPOSE, COMPOSE_CPU


def test_the_cpu_trainer_checkpoints_more_often_than_the_gpu_trainer():
    gpu = load_compose(COMPOSE)["services"]["trainer"]
    cpu = merge_compose(load_compose(COMPOSE), load_compose(COMPOSE_CPU))["services"]["trainer"]
    every = {
        name: int(service_env(svc)["LMPIPE_CHECKPOINT_EVERY"]) for name, svc in (("gpu", gpu), ("cpu", cpu))
    }
    # `small` on 2 cores: 0.3-1.2 steps/s measured under podman, so 50 steps are 40 s to 3 minutes
    assert every == {"gpu": 500, "cpu": 50}
    # still a setting: LMPIPE_CHECKPOINT_EVERY from the shell or .env wins
    assert interpolate(cpu["environment"]["LMPIPE_CHECKPOINT_EVERY"], {"LMPIPE_CHECKPOINT_EVERY": "7"}) == "7"
