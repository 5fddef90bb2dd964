"""`lmpipe run`: N producer processes plus the trainer in this process, stopped together.

Producers are real processes (`python -m lmpipe.producer`) talking to the trainer over real TCP sockets on
loopback, exactly as in a multi-host deployment. They share this process group, so Ctrl-C reaches all of
them; on SIGTERM, or when training ends, the trainer tells them to stop and this launcher reaps them
(terminate, then kill) so nothing is left behind. `--exit-with-parent` makes them quit if the launcher
itself dies without cleaning up.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from lmpipe.cli import _trainer_signals, linger, report, train_config_from_args
from lmpipe.shared.config import pipeline_argv, pipeline_from_args

log = logging.getLogger("lmpipe")


def spawn_producers(ns: argparse.Namespace, cfg, metrics_base: int | None) -> list[subprocess.Popen]:
    # Everything is passed as flags; LMPIPE_* variables would otherwise leak into the children's defaults.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_") or k == "LMPIPE_LOG_LEVEL"}
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    procs = []
    for i in range(cfg.producers):
        port = (
            -1
            if metrics_base is None or metrics_base < 0
            else (0 if metrics_base == 0 else metrics_base + 1 + i)
        )
        env["LMPIPE_LOG_LEVEL"] = ns.log_level
        linger = ["--metrics-linger", str(ns.metrics_linger)] if ns.metrics_linger > 0 else []
        cmd = [
            sys.executable,
            "-m",
            "lmpipe.producer",
            *pipeline_argv(cfg),
            "--worker",
            str(i),
            "--metrics-port",
            str(port),
            "--exit-with-parent",
            *linger,
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def reap(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """Wait for producers that were told to stop; terminate, then kill, the ones that do not."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            log.warning("producer pid %d ignored SIGTERM; killing it", p.pid)
            p.kill()
            p.wait()


def run_local(ns: argparse.Namespace) -> int:
    from lmpipe.consumer.report import print_status
    from lmpipe.consumer.trainer import Trainer

    cfg = pipeline_from_args(ns)
    tcfg = train_config_from_args(ns, ns.metrics_port)
    trainer = Trainer(cfg, tcfg)  # builds the model first: a bad flag fails before any process starts
    _trainer_signals(trainer)
    # under torchrun the trainer is one rank: its producers get that rank's share, port and metrics ports
    procs = spawn_producers(ns, trainer.pcfg, trainer.cfg.metrics_port)
    log.info("started %d producer process(es): pids %s", len(procs), " ".join(str(p.pid) for p in procs))

    def producers_alive() -> str | None:
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0):
                return f"producer {i} exited with code {p.returncode}"
        return None

    trainer.health_check = producers_alive
    try:
        summary = trainer.run(progress=lambda step, st: print_status(step, st, tcfg.steps))
        if trainer.dist.is_main:  # under torchrun, rank 0 reports for the job
            report(summary, ns.summary_json)
        if not trainer.interrupted:
            linger(ns.metrics_linger)  # the producers linger as long, side by side
    finally:
        reap(procs)
    bad = [p.returncode for p in procs if p.returncode not in (0, -15)]
    if bad:
        log.error("producer exit codes: %s", [p.returncode for p in procs])
        return 1
    return 0
