"""A corpus record (a document, or a bad record with its reason) and a process's count of bad ones."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

LOGGED_BAD_RECORDS = 10  # bad records a process logs one by one; the rest are counted


class BadRecords:
    """A process's bad records: the first LOGGED_BAD_RECORDS each get a line (file:line, what, why), then a
    line at 100, 1,000, ... says how many so far, so that a mis-encoded corpus cannot flood the log; every
    one is counted, by reason. `who`: whose count it is when the process does not read the whole corpus (a
    producer reads the shards it holds): "this producer skipped N bad records", not "N bad records skipped",
    which reads as the corpus's."""

    def __init__(self, log: logging.Logger, who: str = ""):
        self.log = log
        self.who = who
        self.counts: dict[str, int] = {}
        self.total = 0

    def __call__(self, reason: str, where: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.total += 1
        if self.total <= LOGGED_BAD_RECORDS:
            self.log.warning("%s: %s (%s), skipped", where, detail, reason)
            if self.total == LOGGED_BAD_RECORDS:
                self.log.warning("more bad records are counted, not logged one by one")
        elif self.total >= 100 and str(self.total).rstrip("0") == "1":
            self.log.warning("%s so far", self.summary())

    def summary(self) -> str:
        by = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.counts.items()))
        records = "bad record" if self.total == 1 else "bad records"
        if self.who:
            return f"{self.who} skipped {self.total:,} {records} ({by})"
        return f"{self.total:,} {records} skipped ({by})"


@dataclass
class Record:
    rid: int  # record id: index across the corpus
    text: str | None = None
    ids: list[int] | np.ndarray | None = None  # a JSON record's list, or a shard's array
    # 0/1 per token of `ids` (1: trained as a target, i.e. predicted from the tokens before it); None: all
    loss_mask: list[int] | np.ndarray | None = None
    # prompt/completion records: `text` is the completion; the prompt is context, never trained
    prompt: str | None = None
    where: str = ""  # file:line of the record's first line
    bad: tuple[str, str] | None = None  # (reason, detail) when the whole record is rejected
    warnings: list[tuple[str, str, str]] | None = None  # (reason, where, detail) for skipped lines inside
