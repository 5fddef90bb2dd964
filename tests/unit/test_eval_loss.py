"""Evaluation on held-out data: the launcher makes --eval-data's batches with the producers' own code (the
same batches every time), and the trainer's Evaluator scores them with the training loss's definition, at
every --eval-every step and at the end, into the log, the metric and the summary."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.evaluate import Evaluator
from lmpipe.consumer.inputs import MaskCache
from lmpipe.consumer.report import Summary
from lmpipe.evaldata import held_out
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.settings import SettingsError
from tests.helpers import short_texts, tiny_model


@pytest.fixture
def held(tmp_path: Path) -> Path:
    path = tmp_path / "held.txt"
    path.write_text("\n\n".join(short_texts(120, seed=7)))
    return path


def _cfgs(held: Path, strategy: str = "pack", k: int = 3) -> tuple[PipelineConfig, TrainConfig]:
    return (
        PipelineConfig(strategy=strategy, seq_len=64, batch_size=4),
        TrainConfig(eval_data=[str(held)], eval_batches=k, eval_every=2),
    )


@pytest.mark.parametrize("strategy", ["pack", "bucket"])
def test_held_out_batches_are_the_same_every_time(held: Path, strategy: str):
    cfg, tcfg = _cfgs(held, strategy)
    first, again = held_out(cfg, tcfg), held_out(cfg, tcfg)
    assert len(first) == 3
    for a, b in zip(first, again, strict=True):
        assert a.strategy == strategy and a.tokens.shape[0] <= 4 and a.tokens.shape[1] <= 64
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.doc_id, b.doc_id)
    if strategy == "pack":  # the corpus's order: no shuffle (bucket groups by length)
        assert list(first[0].doc_id[:2]) == [0, 1]
    assert held_out(cfg, TrainConfig()) == []  # no --eval-data: nothing read


def test_bad_eval_data_is_one_line_naming_eval_data(tmp_path: Path):
    cfg = PipelineConfig(seq_len=64, batch_size=4)
    with pytest.raises(SettingsError, match=r"^--eval-data: .*nowhere\.txt"):
        held_out(cfg, TrainConfig(eval_data=[str(tmp_path / "nowhere.txt")]))
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(SettingsError, match=r"^--eval-data: no documents"):
        held_out(cfg, TrainConfig(eval_data=[str(tmp_path / "blank.txt")]))


def test_evaluator_scores_the_mean_loss_per_target_without_training(held: Path):
    cfg, tcfg = _cfgs(held)
    batches = held_out(cfg, tcfg)
    model = tiny_model(vocab=1152).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = TrainerMetrics(CollectorRegistry())
    ev = Evaluator(batches, 2, model, nullcontext, torch.device("cpu"), "dense", MaskCache(), metrics)

    # by hand: each batch's summed loss over its targets (next token, same document), over all targets
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            idx = torch.from_numpy(b.tokens.astype(np.int64))
            logits = []
            for row in range(idx.shape[0]):
                seg = b.seg[row].astype(np.int64)
                for doc in np.unique(seg[: b.lengths[row]]):
                    cols = np.nonzero((seg == doc) & (np.arange(len(seg)) < b.lengths[row]))[0]
                    ids = idx[row, cols[0] : cols[-1] + 1][None]
                    out, _ = model(ids, torch.arange(ids.shape[1])[None], _causal())
                    logits.append(torch.nn.functional.cross_entropy(out[0, :-1], ids[0, 1:], reduction="sum"))
                    n += ids.shape[1] - 1
            total += float(sum(logits))
    assert n == ev.targets
    assert ev.loss() == pytest.approx(total / n, rel=1e-4)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    summary = Summary()
    for step in range(1, 6):  # every 2 steps, then the end (step 5), never twice for one step
        ev.maybe(step, summary)
    ev.maybe(5, summary, end=True)
    ev.maybe(5, summary, end=True)
    assert [e["step"] for e in summary.evals] == [2, 4, 5]
    assert summary.eval_loss == summary.evals[-1]["eval_loss"] == pytest.approx(total / n, rel=1e-4)
    assert metrics.eval_loss._value.get() == pytest.approx(summary.eval_loss)
    other = Summary()
    ev.maybe(6, other, is_main=False)  # under torchrun rank 0 evaluates and speaks for the job
    assert other.evals == [] and math.isnan(other.eval_loss)
    summary.steps, summary.losses = 5, [5.0, 4.0]
    assert f"eval loss {summary.eval_loss:.3f} (step 5)" in summary.render()


def _causal():
    from lmpipe.consumer.model import AttnSpec

    return AttnSpec("causal")


def test_dry_run_says_the_evaluation_and_refuses_bad_eval_data(
    lmpipe_cli, held: Path, tmp_path: Path, port: int
):
    args = (
        "run",
        "--dry-run",
        "--port",
        str(port),
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--eval-every",
        "50",
    )
    r = lmpipe_cli(*args, "--eval-data", str(held), "--eval-batches", "2")
    assert r.returncode == 0, r.stderr
    assert f"evaluation every 50 steps and at the end: 2 batches of {held}" in r.stdout
    bad = lmpipe_cli(*args, "--eval-data", str(tmp_path / "nowhere.txt"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--eval-data" in bad.stderr
