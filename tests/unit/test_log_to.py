"""`--log-to tensorboard:DIR` and `--log-to wandb`: optional extras, off by default, W&B offline unless
WANDB_MODE says otherwise. The packages are not dev dependencies: tests that need them skip without them;
the plumbing is tested with a stand-in `wandb` module recording what lmpipe calls."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from lmpipe.consumer.evaluate import Evaluator
from lmpipe.consumer.inputs import MaskCache
from lmpipe.consumer.report import Summary
from lmpipe.consumer.sinks import Sinks
from lmpipe.shared.metrics import TrainerMetrics
from tests.helpers import batch_meta, run_stats, tiny_model

HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None


class FakeWandb:
    """What lmpipe calls of wandb: init(project, config, mode), then run.log(values, step), run.finish()."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(log=lambda values, step: self.logged.append((step, dict(values))),
                               finish=lambda: setattr(self, "finished", self.finished + 1))  # fmt: skip


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "")  # none: lmpipe's default (offline), whatever this shell says
    return fake


def test_intervals_and_evaluations_reach_wandb_offline(fake_wandb):
    sinks = Sinks(["wandb:myproj"], {"train": {"lr": 1e-3}})
    assert fake_wandb.inits == [{"project": "myproj", "config": {"train": {"lr": 1e-3}}, "mode": "offline"}]
    stats = run_stats("cpu")
    stats.sinks = sinks
    stats.add_step([batch_meta(4, 2)], torch.tensor(3.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.close_interval(1, 1e-3, torch.tensor(0.5), None)
    stats.report()
    step, values = fake_wandb.logged[0]
    assert step == 1 and values["train/loss"] == 1.5 and values["train/lr"] == 1e-3
    assert values["train/grad_norm"] == 0.5 and "train/tokens_per_second" in values

    import numpy as np

    from lmpipe.shared.batch import Batch, Cursor

    tokens = np.arange(8, dtype=np.uint16).reshape(1, 8)
    batch = Batch(tokens, np.array([8], np.int32), np.array([0]), np.array([0], np.int32), np.array([8], np.int32),
                  "pad", Cursor())  # fmt: skip
    ev = Evaluator([batch], 5, tiny_model(vocab=64), nullcontext, torch.device("cpu"), "dense", MaskCache(),
                   TrainerMetrics(CollectorRegistry()))  # fmt: skip
    ev.sinks = sinks
    ev.maybe(5, Summary())
    assert fake_wandb.logged[-1][0] == 5 and set(fake_wandb.logged[-1][1]) == {"eval/loss"}
    sinks.close()
    assert fake_wandb.finished == 1


def test_online_only_when_the_user_says_so_and_only_rank_0_writes(fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    Sinks(["wandb"], {})
    assert fake_wandb.inits[-1]["mode"] == "online" and fake_wandb.inits[-1]["project"] == "lmpipe"
    assert not Sinks(["wandb"], {}, is_main=False) and len(fake_wandb.inits) == 1


@pytest.mark.parametrize(
    "value, said",
    [
        ("mlflow", "'mlflow': choose tensorboard:DIR, wandb or wandb:PROJECT"),
        ("tensorboard", "tensorboard needs the folder"),
        ("wandb:", "wandb:PROJECT needs a project name"),
    ],
)
def test_a_bad_log_to_is_one_line(lmpipe_cli, value: str, said: str):
    r = lmpipe_cli("run", "--dry-run", "--log-to", value)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr


@pytest.mark.skipif(HAS_TB, reason="tensorboard is installed: nothing is missing")
def test_a_missing_extra_is_one_line_before_anything_starts(lmpipe_cli, tmp_path: Path, port: int):
    r = lmpipe_cli("run", "--dry-run", "--port", str(port), "--log-to", f"tensorboard:{tmp_path / 'tb'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert (
        "the tensorboard package is not installed" in r.stderr
        and "pip install 'lmpipe[tensorboard]'" in r.stderr
    )


@pytest.mark.skipif(
    not HAS_TB, reason="tensorboard is not installed (an optional extra, not a dev dependency)"
)
def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = Sinks([f"tensorboard:{tmp_path}"], {})
    sinks.log(3, {"train/loss": 2.5, "eval/loss": 2.75})
    sinks.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(3, 2.75)]


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (an optional extra, not a dev dependency)")
def test_a_real_wandb_run_stays_offline(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "")
    sinks = Sinks(["wandb:lmpipe-test"], {"x": 1})
    sinks.log(1, {"train/loss": 2.0})
    sinks.close()
    assert list(tmp_path.rglob("offline-run-*")), "an offline run folder, nothing uploaded"
