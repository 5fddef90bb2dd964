"""Scraping a /metrics endpoint over HTTP and reading its samples."""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One scrape of a /metrics endpoint: {(sample name, sorted labels): value}."""

    def __init__(self, text: str):
        self.samples: dict[tuple[str, tuple], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def get(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"{name}{labels or ''} is not served"
        return self.samples[key]

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {dict(lb)[label]: v for (n, lb), v in self.samples.items() if n == name and label in dict(lb)}

    def histogram(self, name: str, **labels) -> tuple[float, float]:
        """(count, sum) of the series with `labels`, after checking the buckets are cumulative and +Inf
        equals the count."""
        want = set(labels.items())
        buckets = sorted(
            (float(dict(lb)["le"]), v)
            for (n, lb), v in self.samples.items()
            if n == f"{name}_bucket" and set(lb) - {("le", dict(lb)["le"])} == want
        )
        assert buckets, f"{name}{labels or ''}: no buckets served"
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{name}: buckets are not cumulative: {buckets}"
        assert buckets[-1][0] == math.inf
        count, total = self.get(f"{name}_count", **labels), self.get(f"{name}_sum", **labels)
        assert buckets[-1][1] == count and total >= 0
        return count, total


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        return Scrape(r.read().decode())


def wait_for_scrape(port: int, timeout: float = 60) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
