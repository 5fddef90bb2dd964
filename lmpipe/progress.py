"""Progress of long one-shot work (`lmpipe tokenizer train`, `lmpipe prepare`), on stderr.

On a terminal: one line rewritten in place, at most a few times a second. Otherwise (a log file, CI): a
full line every few seconds, so that a log shows the work moving without drowning in it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from lmpipe.consumer.report import duration  # one way to write a duration, the trainer's live line's


class Progress:
    """Counts items and bytes of `what`; `total_bytes` (when known) gives a percentage and an ETA."""

    def __init__(
        self,
        what: str,
        total_bytes: int | None = None,
        *,
        unit: str = "documents",
        every: float = 5.0,
        stream: TextIO | None = None,
    ):
        self.what, self.total, self.unit = what, total_bytes or None, unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = 0.2 if self.tty else every
        self.items = self.bytes = 0
        self.start = self._last = time.monotonic()

    def line(self, final: bool = False) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.bytes / elapsed if elapsed > 0 else 0.0
        text = f"{self.what}: {self.items:,} {self.unit}, {self.bytes / 1e6:,.1f} MB"
        if self.total:
            # 100% is the final line's alone: until then the work is not over, whatever the count says
            pct = 100 if final else min(int(100 * self.bytes / self.total), 99)
            text += f" of {self.total / 1e6:,.1f} MB ({pct}%)"
        text += f", {rate / 1e6:,.1f} MB/s, {duration(elapsed)} elapsed"
        if not final and self.total and rate > 0 and self.bytes < self.total:
            text += f", ETA {duration((self.total - self.bytes) / rate)}"
        return text

    def update(self, items: int = 1, nbytes: int = 0) -> None:
        self.items += items
        self.bytes += nbytes
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._write(self.line())

    def done(self, tail: str = "") -> None:
        """The last line, kept on screen, once the whole pass is read. It counts the total as read: the
        bytes counted on the way are the records' text, without the newlines and blank lines between
        them (a finished pass over a plain-text corpus said 96%)."""
        if self.total:
            self.bytes = max(self.bytes, self.total)
        self._write(self.line(final=True) + (f"; {tail}" if tail else ""), end=True)

    def _write(self, text: str, end: bool = False) -> None:
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}" + ("\n" if end else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def texts(self, texts: Iterable[str], then: str = "") -> Iterator[str]:
        """`texts`, counted as they are taken (UTF-8 bytes); at their end the last line, with what comes
        `then`."""
        for t in texts:
            self.update(1, len(t.encode("utf-8", "surrogatepass")))
            yield t
        self.done(then)


def text_bytes(corpus: Any) -> int | None:
    """The bytes a pass over `corpus` reads, where that is its size on disk: local, uncompressed plain text
    (other formats hold more or less than their text); None where unknown."""
    files = corpus.paths
    if not files or any(f.remote is not None or f.compression is not None or f.fmt != "text" for f in files):
        return None
    return sum(f.size for f in files)


class CountedCorpus:
    """A corpus whose records are counted into `progress` as a reader takes them; otherwise the corpus."""

    def __init__(self, corpus: Any, progress: Progress):
        self._corpus, self._progress = corpus, progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._corpus, name)

    def records(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for rec in self._corpus.records(*args, **kwargs):
            self._progress.update(1, len(rec.text.encode("utf-8", "surrogatepass")) if rec.text else 0)
            yield rec
