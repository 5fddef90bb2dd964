"""What shared/metrics.py exports, as Prometheus sees it: the dashboard and the alert rules may use only
these names and labels."""

from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase

from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.metrics_producer import ProducerMetrics


def metric_families() -> dict[str, tuple[str, set[str]]]:
    """Every family of shared/metrics.py: name -> (type, label names). Read from the metric objects: a
    labelled metric without children (e.g. tokens by strategy) collects no sample to learn its labels from."""
    out = {}
    for holder in (ProducerMetrics(), TrainerMetrics()):
        families = [
            m for m in vars(holder).values() if isinstance(m, MetricWrapperBase) and not m._labelvalues
        ]
        ours = [f for f in holder.registry.collect() if f.name.startswith("lmpipe_")]  # not process_*
        assert len(families) == len(ours), "every family is found"
        for m in families:
            out[m._name] = (m._type, set(m._labelnames))
    return out


def sample_names() -> dict[str, set[str]]:
    """Every sample name Prometheus can see -> the label names it carries."""
    names = {}
    for fam, (kind, labels) in metric_families().items():
        if kind == "counter":
            names[f"{fam}_total"] = labels
        elif kind == "histogram":
            names[f"{fam}_bucket"] = labels | {"le"}
            names[f"{fam}_sum"] = names[f"{fam}_count"] = labels
        elif kind == "info":
            names[f"{fam}_info"] = labels
        else:
            names[fam] = labels
    return names
