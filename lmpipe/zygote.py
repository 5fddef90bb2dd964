"""The library's local producers (lmpipe/loader.py), forked from a zygote.

A Loader never forks the user's process (it may hold CUDA, threads and locks) and never uses
multiprocessing's spawn (it re-runs the user's script without a main guard). A new interpreter per producer
costs each one lmpipe's imports and the tokenizer's load (about 0.45 CPU-s), all of them at once. So the
Loader's constructor starts ONE clean interpreter, the zygote (`python -m lmpipe.zygote FD`), which imports
the producer's modules, loads the tokenizer, and waits warm while the user's script goes on; the Loader's
start() has it fork the producers from itself: a fresh single-threaded interpreter forks safely, as `lmpipe
run`'s launcher does before it imports torch (lmpipe/procs.py).

Each producer stays visible to the Loader one by one (Zygote.producers, with Popen's pid, poll, returncode,
wait, terminate and kill), through two pipes:

- the zygote's stdin, Loader -> zygote: the settings as one JSON line, `fork`, then `signal I SIGNUM` lines.
  Its end (the Loader closed it, or the Loader's process is gone) makes a warm zygote exit, and a forked one
  stop the producers left (SIGTERM, then SIGKILL after GRACE seconds) and exit once it has reaped them all
  (a Loader closed before it started kills its warm zygote outright: it holds nothing);
- the events pipe (its descriptor's number in argv), zygote -> Loader, one line per event: `started I PID`,
  `exit I CODE` once the zygote has reaped producer I (CODE as Popen's returncode: -N after signal N), and
  `error MESSAGE` when the zygote could not start.

The chain of exits: the Loader's process gone -> its end of stdin closes (and the zygote's parent changes)
-> the zygote stops its producers, then exits; the zygote gone, even by kill -9 -> the kernel kills its
producers (Linux's parent-death signal; elsewhere they quit on their own, --exit-with-parent), and the
Loader, seeing the events pipe close before their exits, stops in one line (Zygote.problem).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path

from lmpipe.options import ProduceOptions
from lmpipe.shared.config import PipelineConfig

log = logging.getLogger("lmpipe")
GRACE = 5.0  # seconds the producers get to stop after a SIGTERM before a SIGKILL
PARENT_EVERY = 1.0  # seconds between the zygote's looks at its parent (its stdin's end is the quick way)


# -- the Loader's side ----------------------------------------------------------------------------------


class ZygoteProducer:
    """One producer forked by the zygote, with the parts of subprocess.Popen's interface that reap() and the
    Loader use. Its pid comes with the zygote's `started` event, its returncode with its `exit` event."""

    def __init__(self, zygote: Zygote, index: int):
        self.zygote, self.index = zygote, index
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"producer {self.pid}", timeout or 0.0)
            self.zygote.pump(left)
        return self.returncode

    def terminate(self) -> None:
        self.zygote.signal(self.index, signal.SIGTERM)

    def kill(self) -> None:
        self.zygote.signal(self.index, signal.SIGKILL)


class Zygote:
    """The zygote process and its producers, from the Loader's side. Started, it warms up (imports, the
    tokenizer) and waits; fork() has it fork the producers."""

    def __init__(self, cfg: PipelineConfig, metrics_base: int | None, log_level: str):
        import lmpipe

        env = dict(os.environ)
        root = str(Path(lmpipe.__file__).resolve().parent.parent)  # the lmpipe this process runs, not another
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # producers tokenize in threads; the zygote never tokenizes before it forks them
        env.setdefault("TOKENIZERS_PARALLELISM", "true")
        spec = {"cfg": asdict(cfg), "metrics_base": metrics_base, "log_level": log_level}
        self._lock = threading.Lock()  # pump() may run in the training thread and in a finalizer
        self._buf = b""
        self.error: str | None = None  # the zygote's own `error` line
        self.died: str | None = None  # the zygote went before its producers' exits: why, in one line
        self.producers = [ZygoteProducer(self, i) for i in range(cfg.producers)]
        self.forked = False
        self._owner = os.getpid()  # a fork of this process (the user's own workers) must not end it
        r, w = os.pipe()
        try:
            cmd = [sys.executable, "-m", "lmpipe.zygote", str(w)]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, pass_fds=(w,))
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._events = r
        try:
            self._send(json.dumps(spec))
        except BaseException:  # Ctrl-C half-way: nobody else holds it
            self.proc.kill()
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fork(self) -> None:
        """Have the zygote fork the producers (wait_started gives their pids)."""
        self.forked = True
        try:
            self._send("fork")
        except (OSError, ValueError):  # the zygote is gone: wait_started says so
            self.pump(0.0)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def signal(self, index: int, signum: int) -> None:
        """Ask the zygote to signal producer `index` (it does so only while that one is not reaped: no pid
        of another process is ever hit)."""
        if self.producers[index].returncode is None:
            try:
                self._send(f"signal {index} {int(signum)}")
            except (OSError, ValueError):  # the zygote is gone, and its producers with it
                self.pump(0.0)

    def pump(self, timeout: float) -> None:
        """Read the zygote's events, waiting up to `timeout` seconds for the first."""
        with self._lock:
            if self._events < 0:
                return
            ready, _, _ = select.select([self._events], [], [], max(0.0, timeout))
            if not ready:
                return
            data = os.read(self._events, 65536)
            if not data:
                self._ended()
                return
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                self._event(line.decode(errors="replace"))

    def _event(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        if kind == "error":
            self.error = rest
            return
        index, value = (int(x) for x in rest.split())
        if kind == "started":
            self.producers[index].pid = value
        elif kind == "exit":
            self.producers[index].returncode = value

    def _ended(self) -> None:
        """The events pipe closed: the zygote is gone. Producers whose exit it did not report went with it."""
        os.close(self._events)
        self._events = -1
        try:
            code = self.proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:  # it closed the pipe but lives on: it must not
            self.proc.kill()
            try:
                code = self.proc.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:  # stuck in the kernel: close() says so
                code = -signal.SIGKILL
        lost = [p for p in self.producers if p.returncode is None]
        if lost and self.error is None:
            how = f"exited with code {code}"
            if code < 0:
                with suppress(ValueError):
                    how = f"was killed by {signal.Signals(-code).name}"
            self.died = f"the producers' zygote (pid {self.pid}) {how}; its producers went with it"
        for p in lost:
            if p.pid is not None:
                _wait_gone(p.pid, GRACE)
            p.returncode = -signal.SIGKILL  # the parent-death signal the zygote armed in each of them

    def wait_started(self) -> list[int]:
        """The producers' pids, once the zygote has forked them all; RuntimeError if it could not."""
        while self.error is None and self.died is None and any(p.pid is None for p in self.producers):
            self.pump(1.0)
        if self.error is not None or self.died is not None:
            raise RuntimeError(f"the local producers could not start: {self.error or self.died}")
        return [p.pid for p in self.producers if p.pid is not None]

    def problem(self) -> str | None:
        """A reason to stop the run: the zygote died, or a producer exited with an error."""
        self.pump(0.0)
        if self.error is not None or self.died is not None:
            return self.error or self.died
        for p in self.producers:
            if p.returncode not in (None, 0):
                return f"producer {p.index} exited with code {p.returncode}"
        return None

    def stop(self, grace: float = GRACE) -> None:
        """After the producers were told to stop: wait for them (up to `grace`), terminate, then kill the
        ones that do not (procs.reap, as `lmpipe run`), then end the zygote. Idempotent."""
        from lmpipe.procs import reap

        if os.getpid() != self._owner:
            return
        if not self.forked:  # a warm zygote holds nothing: it goes at once
            self.proc.kill()
            self.close()
            return
        try:
            self.pump(0.0)
            reap([p for p in self.producers if p.pid is not None and p.returncode is None], grace)
        finally:
            self.close()

    def close(self) -> None:
        """End the zygote: its stdin closed, it stops the producers still running and exits; its events read
        to their end, so that every producer's returncode is known. Idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with suppress(OSError):  # the zygote is gone (EPIPE on the flush)
                self.proc.stdin.close()
        try:  # it takes at most GRACE to stop its producers, then kills them
            self.proc.wait(timeout=2 * GRACE)
        except subprocess.TimeoutExpired:
            log.warning("the producers' zygote (pid %d) did not exit %.0f s after its stop; killing it",
                        self.pid, 2 * GRACE)  # fmt: skip
            self.proc.kill()
        # its exits, up to the end of the pipe: it comes with the zygote's, as its producers closed their copy
        deadline = time.monotonic() + GRACE
        while self._events >= 0 and (left := deadline - time.monotonic()) > 0:
            self.pump(left)
        if self._events >= 0:
            log.warning("the events pipe of the producers' zygote (pid %d) is still open %.0f s after its "
                        "stop (a process it forked holds it); not reading it further", self.pid, GRACE)  # fmt: skip
            with self._lock:
                if self._events >= 0:
                    self._ended()
        try:
            self.proc.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            log.error(
                "the producers' zygote (pid %d) did not exit after SIGKILL; not waiting longer", self.pid
            )


def _wait_gone(pid: int, seconds: float) -> None:
    """Until a process this one cannot wait for (an orphan now) has ended."""
    deadline = time.monotonic() + seconds
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:  # a zombie has ended: its new parent reaps it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not Path("/proc/self").exists()  # a /proc without this pid: gone


# -- the zygote's side ----------------------------------------------------------------------------------


def _emit(fd: int, line: str) -> bool:
    """One event to the Loader; False once the Loader is gone."""
    try:
        os.write(fd, line.encode() + b"\n")
        return True
    except OSError:
        return False


class _Stdin:
    """The Loader's lines on the zygote's stdin, read without buffering (select() watches the descriptor)."""

    def __init__(self) -> None:
        self.buf = b""
        self.eof = False

    def read(self) -> list[bytes]:
        """What has come (the descriptor is readable, or this blocks): the complete lines."""
        data = os.read(0, 65536)
        self.eof = not data
        *lines, self.buf = (self.buf + data).split(b"\n")
        return lines


def _producer(
    cfg: PipelineConfig, opts: ProduceOptions, log_level: str, parent: int, close: list[int]
) -> None:
    """A forked producer: never returns to the zygote's code."""
    code = 1
    try:
        for fd in close:  # the events pipe above all: the Loader sees its end when the zygote is gone
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from lmpipe.procs import _producer_main, die_with_parent

        die_with_parent(parent)  # the zygote
        _producer_main(cfg, opts, log_level)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            for t in threading.enumerate():  # what a Python process's exit does: its threads finish first
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _Zygote:
    """The zygote's loop: relays its producers' exits and the Loader's signals, until all are reaped."""

    def __init__(self, events: int, parent: int, stdin: _Stdin, pending: list[bytes]):
        self.events, self.parent, self.stdin, self.pending = events, parent, stdin, pending
        self.children: dict[int, int] = {}  # pid -> producer index, until reaped
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        self.wake_w = wake_w
        self.stop_at: float | None = None  # when the producers were told to stop (SIGTERM)
        self.killed = False
        self.eof = False
        self.term = False
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd wakes select()
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "term", True))

    def fork(self, cfg: PipelineConfig, metrics_base: int | None, log_level: str) -> None:
        me = os.getpid()
        for i in range(cfg.producers):
            if metrics_base is None or metrics_base < 0:
                port = -1
            else:
                port = 0 if metrics_base == 0 else metrics_base + 1 + i
            opts = ProduceOptions(worker=i, metrics_port=port, exit_with_parent=True)
            pid = os.fork()
            if pid == 0:
                _producer(cfg, opts, log_level, me, [self.events, self.wake_r, self.wake_w])
            self.children[pid] = i
            if not _emit(self.events, f"started {i} {pid}"):
                self.eof = True

    def serve(self) -> None:
        while self.children:
            timeout = PARENT_EVERY
            if self.stop_at is not None and not self.killed:
                timeout = min(timeout, max(0.0, self.stop_at + GRACE - time.monotonic()))
            watch = [self.wake_r] if self.eof else [0, self.wake_r]
            ready, _, _ = select.select(watch, [], [], timeout)
            if self.wake_r in ready:
                while True:
                    try:
                        if not os.read(self.wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            if 0 in ready:
                self.pending += self.stdin.read()
                self.eof = self.eof or self.stdin.eof
            self._command()
            self._reap()
            if self.stop_at is None and (self.eof or self.term or os.getppid() != self.parent):
                self.stop_at = time.monotonic()
                self._signal_all(signal.SIGTERM)
            elif self.stop_at is not None and not self.killed and time.monotonic() >= self.stop_at + GRACE:
                self.killed = True
                self._signal_all(signal.SIGKILL)

    def _command(self) -> None:
        lines, self.pending = self.pending, []
        for line in lines:
            words = line.split()
            if len(words) == 3 and words[0] == b"signal":
                index, signum = int(words[1]), int(words[2])
                for pid, i in self.children.items():
                    if i == index:  # still unreaped: the pid is this producer's
                        os.kill(pid, signum)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            index = self.children.pop(pid, None)
            if index is not None and not _emit(
                self.events, f"exit {index} {os.waitstatus_to_exitcode(status)}"
            ):
                self.eof = True  # the Loader is gone: stop the rest

    def _signal_all(self, signum: int) -> None:
        for pid in self.children:
            with suppress(ProcessLookupError):
                os.kill(pid, signum)


def main() -> None:
    """`python -m lmpipe.zygote FD`: the settings on stdin, then `fork`; the events to FD."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the producers and the Loader to handle
    events, parent, stdin = int(sys.argv[1]), os.getppid(), _Stdin()
    lines: list[bytes] = []
    while not lines and not stdin.eof:
        lines = stdin.read()
    try:
        spec = json.loads(lines.pop(0))
        cfg = PipelineConfig(**spec["cfg"])
        from lmpipe.checks import check_tokenizer
        from lmpipe.procs import _producer_main  # noqa: F401  # imported once here, for every producer
        from lmpipe.producer import manager  # noqa: F401

        if sys.platform.startswith("linux"):
            import ctypes  # noqa: F401  # for the producers' parent-death signal

        check_tokenizer(cfg)  # loaded once here: the producers find it loaded (shared/tokenizer.py)
    except Exception as exc:
        _emit(events, f"error {type(exc).__name__}: {exc}".replace("\n", " "))
        sys.exit(2)
    # warm: idle until the Loader starts (`fork`); its end of stdin or its process gone: nothing to fork
    while not lines:
        if stdin.eof or os.getppid() != parent:
            return
        if select.select([0], [], [], PARENT_EVERY)[0]:
            lines = stdin.read()
    if lines.pop(0) != b"fork":
        return
    zygote = _Zygote(events, parent, stdin, lines)
    zygote.fork(cfg, spec["metrics_base"], spec["log_level"])
    zygote.serve()


if __name__ == "__main__":
    main()
