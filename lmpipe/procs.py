"""`lmpipe run`'s producer processes, forked from the launcher, and the launcher's handling of signals.

They share the launcher's process group, so Ctrl-C reaches all of them; on SIGTERM, or when training ends,
the trainer tells them to stop and the launcher reaps them (terminate, then kill) so nothing is left
behind. `--exit-with-parent` makes them quit if the launcher itself dies without cleaning up.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmpipe.checks import check_corpus, check_keys, check_tokenizer, say_no_effect
from lmpipe.options import ProduceOptions
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError

if TYPE_CHECKING:
    import multiprocessing.process

    from lmpipe.producer.corpora import Corpora
    from lmpipe.zygote import ZygoteProducer

log = logging.getLogger("lmpipe")


def stop_on_signals(trainer) -> None:
    def handler(signum, _frame):
        name = signal.Signals(signum).name
        log.info("%s: finishing the current step, then stopping", name)
        trainer.request_stop(name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def linger(seconds: float) -> None:
    """Sleep after the work, /metrics still served by its daemon thread; a signal cuts it short."""
    if seconds <= 0:
        return
    log.info("work done; serving metrics for %.0f s more", seconds)
    done = threading.Event()
    # the trainer's handlers only ask a finished run to stop: here a signal must end the wait itself
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait(seconds)


class LocalProducer:
    """A producer process forked by this launcher, with the parts of subprocess.Popen's interface the
    launcher uses (pid, poll, returncode, wait, terminate, kill)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode  # -N when a signal N ended it, as Popen's

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"producer {self.pid}", timeout or 0.0)
        return self.proc.exitcode

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


def _producer_main(cfg: PipelineConfig, opts: ProduceOptions, log_level: str) -> None:
    """A forked producer: what `lmpipe produce` does, with its errors as that command reports them."""
    from lmpipe.shared.log import setup

    setup(f"producer {opts.worker}", log_level)
    try:
        code = produce(cfg, opts)
    except (SettingsError, ValueError, OSError) as exc:
        log.error("%s", exc)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """This process is killed when `parent` (the process that forked it) dies: the parent-death signal
    (Linux); it exits at once where the parent died before the signal was armed."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _forked_main(cfg: PipelineConfig, opts: ProduceOptions, log_level: str, parent: int) -> None:
    """A producer forked by `lmpipe run`: it dies with the process that forked it. Under torchrun a rank's
    process is not in the agent's process group, so a rank killed with SIGKILL left its producers running
    until they next looked at their parent, holding their metrics ports and talking to the rank that
    replaced it."""
    die_with_parent(parent)
    _producer_main(cfg, opts, log_level)


def fork_producers(
    cfg: PipelineConfig, metrics_base: int | None, linger_s: float, log_level: str
) -> list[LocalProducer]:
    """`lmpipe run`'s producers, forked from this process before it imports torch or starts a thread: they
    begin with lmpipe's modules and the tokenizer the checks loaded (a DataLoader worker's head start),
    where a new interpreter spends about 0.4 s importing and loading them. They connect to the trainer
    as any producer does, retrying until it listens."""
    import multiprocessing  # here: the library's zygote (lmpipe/zygote.py) forks with os.fork

    from lmpipe.producer import manager  # noqa: F401  # imported once here, for every child

    ctx = multiprocessing.get_context("fork")
    # producers tokenize in threads, as when they were spawned; said outright, the tokenizers library does
    # not warn about the fork (this process never tokenizes before it)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    procs = []
    for i in range(cfg.producers):
        if metrics_base is None or metrics_base < 0:
            port = -1
        else:
            port = 0 if metrics_base == 0 else metrics_base + 1 + i
        opts = ProduceOptions(worker=i, metrics_port=port, metrics_linger=linger_s, exit_with_parent=True)
        proc = ctx.Process(
            target=_forked_main, args=(cfg, opts, log_level, os.getpid()), name=f"lmpipe-producer-{i}"
        )
        proc.start()
        procs.append(LocalProducer(proc))
    return procs


def reap(procs: Sequence[LocalProducer | ZygoteProducer | subprocess.Popen], grace: float = 5.0) -> None:
    """Wait for producers that were told to stop; terminate, then kill, the ones that do not. Each stage
    has one deadline for all of them: `grace`, then 3 s after SIGTERM, then 5 s after SIGKILL."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("producer pid %d ignored SIGTERM; killing it", p.pid)
            p.kill()
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:  # bounded too: a process stuck in the kernel (an unresponsive disk) outlives even SIGKILL
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("producer pid %d did not exit 5 s after SIGKILL; not waiting longer", p.pid)


def check_produce(cfg: PipelineConfig, opts: ProduceOptions) -> Corpora:
    """What `lmpipe produce` checks before it starts (its --dry-run too): the corpus it would serve."""
    if opts.worker >= cfg.producers:
        raise SettingsError(f"--worker {opts.worker} must be below --producers {cfg.producers}")
    say_no_effect(cfg)
    check_keys(cfg, server=False)
    return check_corpus(cfg, check_tokenizer(cfg))


def produce(cfg: PipelineConfig, opts: ProduceOptions) -> int:
    """`lmpipe produce`: one producer process, in this process (a forked one runs it too)."""
    from lmpipe.producer.manager import Producer, ProducerOptions, install_signal_handlers

    check_produce(cfg, opts)
    p = Producer(
        cfg,
        ProducerOptions(
            worker=opts.worker, metrics_port=opts.metrics_port, exit_with_parent=opts.exit_with_parent
        ),
    )
    install_signal_handlers(p)
    code = p.run()
    if not p.interrupted:
        linger(opts.metrics_linger)
    return code
