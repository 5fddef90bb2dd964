"""The trainer's live status line on a terminal, with every process's log lines printed above it.

How it works. On a terminal, `lmpipe run` / `lmpipe train` point this process's file descriptor 2 at a pipe
before the producers are forked; the producers inherit it, and so does everything else that writes to
stderr (the trainer's logging, Python warnings, torch's C++ messages, the compiler's worker processes). One
thread reads the pipe and owns the terminal: it prints each complete line above the status line, then draws
the status line again; between lines it redraws the status line twice a second. Nothing else writes to the
terminal's stderr while the line is drawn, so nothing is glued onto it, and the line is cut to the
terminal's width (read at every draw) so it never wraps into a trail.

The step loop pays nothing: the thread reads the trainer's step counter (an int) when it draws, the
logging interval's figures come through the progress callback as before, and the ETA is the pace of the
steps seen in the last minute (Eta), not the last interval's.

Not a terminal (a log file, a pipe, CI), TERM=dumb, or a torchrun rank other than 0: no pipe, no thread,
one plain line per logging interval (consumer/report.py print_status), with the same ETA.

Written here rather than with rich or tqdm: rich's Live redirects only Python's sys.stdout/sys.stderr (the
producers and C-level writers would still glue onto its line) and hides the cursor, and tqdm draws when
update() is called, which would put a call per step into the trainer's loop; the pipe is the part that
matters, and drawing one line on top of it is this module. The cursor is never hidden: a run killed
outright leaves at worst an unended line.

Costs and limits: a draw is about 15 us, twice a second, off the step loop. A terminal made narrower while
the line is drawn may reflow the line into two rows, one of which stays behind (once per resize).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from lmpipe.consumer.report import duration, print_status, status_fields

REFRESH = 0.5  # seconds between draws of the line
WINDOW = 60.0  # the ETA's pace: the steps seen in the last WINDOW seconds
CLEAR = b"\r\x1b[K"  # to the line's start, erase it


class Eta:
    """Time left to `total` steps at the pace of the steps seen in the last `window` seconds. The step the
    counter starts at is not a sample: the first step holds start-up and compilation."""

    def __init__(self, total: int, window: float = WINDOW, starts: bool = True):
        """`starts`: the first step observed is where the counter starts (not a step's end, not a sample)."""
        self.total, self.window = total, window
        self._first: int | None = None if starts else -1
        self._seen: deque[tuple[float, int]] = deque()  # (when it was first seen, step)

    def observe(self, now: float, step: int) -> None:
        if self._first is None:
            self._first = step
        if step == self._first or (self._seen and step == self._seen[-1][1]):
            return
        if self._seen and step < self._seen[-1][1]:
            self._seen.clear()
        self._seen.append((now, step))
        while len(self._seen) > 2 and now - self._seen[1][0] >= self.window:
            self._seen.popleft()

    def left(self, now: float) -> float | None:
        """Seconds left, None without a step limit or before two steps were seen."""
        if not self.total or len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        if s1 >= self.total or t1 <= t0:
            return None
        pace = (t1 - t0) / (s1 - s0)  # seconds a step
        # counts down through a long step, for one step's time at most (a stall is not progress)
        return (self.total - s1) * pace - min(now - t1, pace)


def plain_progress(total: int, stream=None) -> Callable[[int, dict], None]:
    """The progress callback off a terminal: print_status's line per logging interval, with Eta's ETA (none
    in the first interval, whose pace is start-up's)."""
    eta = Eta(total, starts=False)  # the first interval's end is a sample: the pace is measured from it

    def progress(step: int, stats: dict) -> None:
        now = time.monotonic()
        eta.observe(now, step)
        left = eta.left(now)
        print_status(step, stats if left is not None else {**stats, "step_seconds": 0.0}, total,
                     stream=stream or sys.stderr, eta=left)  # fmt: skip

    return progress


def fit(fields: list[tuple[int, str]], width: int) -> str:
    """The fields joined by " | ", the least important dropped (highest rank first) until the line fits in
    `width` columns; cut at the width if even those of rank 0 do not fit."""
    kept = list(fields)
    while len(" | ".join(t for _, t in kept)) > width and any(rank for rank, _ in kept):
        worst = max(range(len(kept)), key=lambda i: (kept[i][0], i))
        del kept[worst]
    return " | ".join(t for _, t in kept)[:width]


class LiveLine:
    """The status line and the pipe under it; on_terminal() makes one where stderr is a terminal."""

    def __init__(self, total: int, tty: int, pipe: int, redirected: bool = False):
        """Draw on `tty`, print what `pipe` brings above; `redirected`: fd 2 is the pipe's (close() puts the
        terminal back)."""
        self.total, self.tty, self.pipe, self.redirected = total, tty, pipe, redirected
        os.set_blocking(pipe, False)  # read by the thread, and by finish(): neither waits on the other's read
        self.eta = Eta(total)
        self._stats: dict | None = None
        self._step: Callable[[], int] | None = None
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._drawn = b""  # what the line shows now (b"": nothing drawn)
        self._drawing = True  # False once finished: lines pass straight through
        self._closing = threading.Event()
        self._drained = threading.Event()
        self._partial = b""
        self._thread = threading.Thread(target=self._serve, name="live-line", daemon=True)

    @classmethod
    def on_terminal(cls, total: int) -> LiveLine | None:
        """Point stderr (fd 2) at a pipe this line reads, where stderr is a terminal and this process speaks
        for the job; None otherwise. start() starts the thread (after any fork: none runs at a fork)."""
        if not os.isatty(2) or os.environ.get("TERM") == "dumb" or os.environ.get("RANK", "0") != "0":
            return None
        sys.stderr.flush()
        tty = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
        line = cls(total, tty, r, redirected=True)
        _Forks.live = line
        if faulthandler.is_enabled():  # a crash's traceback must reach the terminal, not a pipe nobody reads
            faulthandler.enable(file=tty)
        return line

    def start(self) -> None:
        self._thread.start()

    def attach(self, step: Callable[[], int]) -> None:
        """The trainer's step counter, read at each draw; the elapsed time counts from here."""
        self._since = time.monotonic()
        self._step = step

    def interval(self, step: int, stats: dict) -> None:
        """The progress callback: the logging interval's figures, shown from the next draw."""
        self._stats = stats

    def render(self, width: int, final: bool = False) -> str:
        """The line at `width` columns; `final`: the run is over (no time left to show)."""
        now = time.monotonic()
        if self._step is None:
            return fit([(0, f"starting | {duration(now - self._since)}")], width)
        step = self._step()
        self.eta.observe(now, step)
        left = None if final else self.eta.left(now)
        # the clock goes on between intervals; no ETA at the last interval's pace, only Eta's
        stats = {**(self._stats or {}), "elapsed": now - self._since, "step_seconds": 0.0}
        return fit(status_fields(step, stats, self.total, eta=left, live=True), width)

    def _width(self) -> int:
        try:
            columns = os.get_terminal_size(self.tty).columns
        except OSError:
            columns = 0
        return max(10, columns - 1) if columns else 79  # the last column would wrap on some; 0: unknown

    def _draw(self, above: bytes = b"") -> None:
        """Print `above` (complete lines) above the line, then the line; the lock held."""
        line = b""
        if self._drawing:
            try:
                line = self.render(self._width()).encode()
            except Exception as exc:  # the line is lost, never the lines above it: they go on passing
                self._drawing = False
                above += (
                    f"the live status line failed ({type(exc).__name__}: {exc}); no more of it\n".encode()
                )
        if not above and line == self._drawn:
            return
        out = (CLEAR if self._drawn or above else b"") + above + (CLEAR + line if line else b"")
        self._drawn = line
        _write_all(self.tty, out)

    def _serve(self) -> None:
        while True:
            closing = self._closing.is_set()  # set before this wait: an empty pipe now is a drained one
            ready, _, _ = select.select([self.pipe], [], [], 0.05 if closing else REFRESH)
            with self._lock:
                if ready:
                    try:
                        data = os.read(self.pipe, 65536)
                    except BlockingIOError:  # finish() read it meanwhile
                        continue
                    if not data:  # every writer gone
                        self._draw(self._partial + b"\n" if self._partial else b"")
                        self._drained.set()
                        return
                    self._partial += data
                    self._draw(self._take_lines())
                    continue
                if self._partial:  # a line written in pieces, quiet for a while: shown as it is
                    self._partial += b"\n"
                    self._draw(self._take_lines())
                self._draw()
                if closing:
                    self._drained.set()

    def _take_lines(self) -> bytes:
        cut = self._partial.rfind(b"\n") + 1
        lines, self._partial = self._partial[:cut], self._partial[cut:]
        return lines

    def finish(self) -> None:
        """The run is over: the line drawn one last time and ended (it stays on the terminal); lines that
        come later pass straight through."""
        with self._lock:
            if not self._drawing:
                return
            # this process's last lines (the last checkpoint, a SIGINT) are in the pipe: above the line, first
            with contextlib.suppress(BlockingIOError):
                while data := os.read(self.pipe, 65536):
                    self._partial += data
            above = self._take_lines()
            try:
                line = self.render(self._width(), final=True).encode() if self._step is not None else b""
            except Exception:  # said by _draw when it failed there; here the line is only not kept
                line = b""
            _write_all(
                self.tty,
                (CLEAR if self._drawn or above else b"") + above + (CLEAR + line + b"\n" if line else b""),
            )
            self._drawing, self._drawn = False, b""

    def close(self) -> None:
        """finish(), stderr back to the terminal, and what the pipe holds printed (the thread, a daemon,
        passes on what the compiler's workers may still write)."""
        try:
            self.finish()
        finally:
            if self.redirected:
                sys.stderr.flush()
                os.dup2(self.tty, 2)
                if faulthandler.is_enabled():
                    faulthandler.enable(file=sys.stderr)
            self._closing.set()
            if self._thread.is_alive():
                self._drained.wait(2.0)
            else:  # never started (a failure before start()): pass the pipe's contents on here
                with contextlib.suppress(BlockingIOError):
                    while data := os.read(self.pipe, 65536):
                        _write_all(self.tty, data)
            _Forks.live = None


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # the terminal is gone (a closed ssh session): nothing to show it on
        pass


class _Forks:
    """A process forked while the line is drawn (a producer) writes to the pipe through its fd 2, and holds
    neither the pipe's reading end nor the terminal: it must not keep them open."""

    live: LiveLine | None = None


def _in_child() -> None:
    live, _Forks.live = _Forks.live, None
    if live is not None:
        if faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr)  # the pipe, as the child's other lines
        for fd in (live.pipe, live.tty):
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
