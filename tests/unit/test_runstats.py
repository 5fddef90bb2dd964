"""The trainer's per-interval report, read one step late (consumer/runstats.py, REPORT_BEHIND): what it
says is the closed interval's, whatever the step queued behind it has changed since."""

from __future__ import annotations

import pytest
import torch

from lmpipe.consumer.runstats import TrainingDiverged
from lmpipe.consumer.scaler import LossScaler
from tests.helpers import batch_meta, run_stats


def test_an_interval_read_a_step_late_reports_its_own_values_not_the_next_steps():
    scaler = LossScaler(init_scale=2.0**16, device="cpu")
    stats = run_stats("cpu", scaler)
    records: list[tuple[int, dict]] = []
    stats.add_step([batch_meta(4, 3)], torch.tensor(6.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.close_interval(1, 1e-3, torch.tensor(0.5), lambda step, st: records.append((step, st)))
    # the next step runs before the report: it overflows, and its loss and norm are another batch's
    scaler._scale.fill_(2.0**15)
    scaler._overflows += 1
    scaler._skipped += 1
    stats.add_step([batch_meta(4, 3)], torch.tensor(30.0), 0.0, 2e-3)  # type: ignore[list-item]
    stats.report()
    stats.close_interval(2, 2e-3, torch.tensor(7.0), lambda step, st: records.append((step, st)))
    stats.report()
    said = [(step, st["loss"], st["grad_norm"], st["lr"], st["loss_scale"], st["overflows"], st["skipped"])
            for step, st in records]  # fmt: skip
    assert said == [(1, 2.0, 0.5, 1e-3, 2.0**16, 0.0, 0.0), (2, 10.0, 7.0, 2e-3, 2.0**15, 1.0, 1.0)]
    # the metrics and the summary say the same
    assert stats.summary.losses == [2.0, 10.0]
    assert stats.metrics.registry.get_sample_value("lmpipe_trainer_scaler_overflows_total") == 1.0


def test_a_closed_interval_is_reported_once():
    stats = run_stats("cpu")
    records: list[int] = []
    stats.add_step([batch_meta(4, 2)], torch.tensor(1.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.close_interval(1, 1e-3, torch.tensor(0.0), lambda step, st: records.append(step))
    stats.report(wait=False)  # off CUDA its values are on the host already
    stats.report()
    stats.close_tail(1)
    assert records == [1] and len(stats.summary.losses) == 1


def test_a_diverged_interval_stops_the_run_in_one_line():
    """A NaN loss was shown as 'n/a' (the sign of an interval without a trained target), the summary gave the
    last finite loss and the run exited 0, writing NaN weights into its checkpoints."""
    stats = run_stats("cpu")
    stats.add_step([batch_meta(4, 3)], torch.tensor(6.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.close_interval(1, 1e-3, torch.tensor(0.5), None)
    stats.add_step([batch_meta(4, 3)], torch.tensor(float("nan")), 0.0, 1e-3)  # type: ignore[list-item]
    stats.add_step([batch_meta(4, 3)], torch.tensor(3.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.report()  # interval 1 is finite
    stats.close_interval(3, 1e-3, torch.tensor(float("nan")), None)
    with pytest.raises(TrainingDiverged, match=r"the loss over steps 2-3 is nan \(not finite\); stopping"):
        stats.report()
    assert stats.summary.losses == [2.0]


def test_a_checkpoint_is_not_written_of_a_diverged_model():
    stats = run_stats("cpu")
    stats.add_step([batch_meta(4, 3)], torch.tensor(6.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.check_finite(1)  # finite so far: the checkpoint may be written
    stats.add_step([batch_meta(4, 3)], torch.tensor(float("inf")), 0.0, 1e-3)  # type: ignore[list-item]
    with pytest.raises(TrainingDiverged, match="the loss over steps 1-2 is inf"):
        stats.check_finite(2)


def test_an_interval_without_a_trained_target_is_not_divergence():
    stats = run_stats("cpu")
    stats.add_step([batch_meta(4, 0)], torch.tensor(0.0), 0.0, 1e-3)  # type: ignore[list-item]
    stats.close_interval(1, 1e-3, torch.tensor(0.0), None)
    stats.report()
    stats.check_finite(1)
    assert stats.summary.losses == []


def test_the_summary_of_one_interval_shows_one_loss_and_one_step():
    """It said `1 steps ... loss 6.856 -> 6.856`, as if nothing had been learned."""
    from lmpipe.consumer.report import Summary

    one = Summary(steps=1, first_loss=6.856, last_loss=6.856, losses=[6.856], seconds=1.0).render()
    assert one.startswith("summary: 1 step in") and "loss 6.856 (one --log-every interval) |" in one, one
    two = Summary(steps=20, first_loss=7.0, last_loss=6.5, losses=[7.0, 6.5], seconds=1.0).render()
    assert two.startswith("summary: 20 steps in") and "loss 7.000 -> 6.500 |" in two, two
