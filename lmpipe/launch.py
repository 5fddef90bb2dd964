"""Starting lmpipe's processes: `lmpipe train` and `lmpipe run` (one path), and `lmpipe produce`.

Each first checks what it cheaply can (lmpipe/checks.py), so that a usage mistake is one line before a
model is built or a process started. `lmpipe run` then forks N producer processes (before it imports
torch: lmpipe/procs.py) talking to the trainer through the same sockets `lmpipe train` + `lmpipe produce`
use (by default Unix sockets in a directory private to this user; TCP with --curve-dir or
--trusted-network; shared/sockets.py), and trains in this process.

Layering: the CLI (lmpipe/cli.py) imports this module, never the reverse. torch is imported only once a
trainer is about to be built, so producers never load it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lmpipe.checks import (
    check_corpus,
    check_device,
    check_keys,
    check_model_folder,
    check_not_an_input,
    check_not_overwritten,
    check_not_read_back,
    check_ports,
    check_resume_corpus,
    check_tokenizer,
    check_writable,
    lock_checkpoint_dir,
    say_left_out,
    say_no_effect,
)
from lmpipe.consumer.config import TrainConfig, per_rank
from lmpipe.consumer.sinks import missing_package
from lmpipe.evaldata import check_held_out, held_out
from lmpipe.live import LiveLine, plain_progress
from lmpipe.options import ReportOptions
from lmpipe.procs import LocalProducer, fork_producers, linger, reap, stop_on_signals
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import SettingsError

log = logging.getLogger("lmpipe")

# -- the run's end ----------------------------------------------------------------------------------


def report(summary, path: str | None) -> None:
    print(summary.render(), flush=True)
    if not path:
        return
    try:
        with open(path, "w") as f:  # standard JSON: an unknown figure (NaN, a run with no step) is null
            json.dump(_no_nan(summary.to_dict()), f, indent=1, allow_nan=False)
    except OSError as exc:  # a full disk says no file name of its own
        raise OSError(f"--summary-json {path}: cannot write it ({exc.strerror or exc})") from None


def _no_nan(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _no_nan(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_no_nan(x) for x in v]
    return v


# -- the commands -------------------------------------------------------------------------------------


@dataclass
class CorpusFacts:
    """What the launcher found about the corpus producers must serve ("": the first producer's)."""

    data: str = ""
    content: str = ""
    versions: str = ""
    objects: dict[str, str] = field(default_factory=dict)  # per remote object (Corpus.object_versions)
    inputs: list[tuple[str, str]] = field(default_factory=list)  # files the run reads: never written over


def train(
    cfg: PipelineConfig, tcfg: TrainConfig, opts: ReportOptions, *, local_producers: bool, log_level: str
) -> int:
    """`lmpipe train` (producers come from elsewhere) and `lmpipe run` (local_producers: started here)."""
    rank_cfg, rank_tcfg = rank_settings(cfg, tcfg, local_producers)
    check_keys(cfg, server=True)
    facts = check_inputs(cfg, tcfg, local_producers)
    check_outputs(cfg, tcfg, opts, facts.inputs)
    say_no_effect(cfg, tcfg)
    if local_producers:
        say_left_out(cfg.all_data())
    # so that a run on the wrong corpus shows it at its start (a mixture's trainer names its sources)
    if local_producers and not cfg.data and not cfg.mixture():
        log.info(
            "data: the built-in corpus (%s generated documents); --data names yours", f"{cfg.builtin_docs:,}"
        )
    mix = cfg.mixture()  # a mixture ends when a source of a finite number of epochs runs out
    finite = any(s.epochs for s in mix.sources) if mix is not None else cfg.epochs
    if local_producers and not tcfg.steps and not finite:  # both documented; together they mean no end
        log.info("--steps 0 and --epochs 0: this run trains until it is stopped (Ctrl-C or SIGTERM)")
    procs: list[LocalProducer] = []
    live = LiveLine.on_terminal(tcfg.steps)  # on a terminal, every line of stderr goes above it (live.py)
    try:
        if local_producers:  # forked now, before torch is imported (lmpipe/procs.py says why)
            procs = fork_producers(rank_cfg, rank_tcfg.metrics_port, opts.metrics_linger, log_level)
        if live is not None:
            live.start()
        return run_trainer(cfg, tcfg, opts, facts, procs, live)
    finally:
        if live is not None:
            live.close()


def rank_settings(
    cfg: PipelineConfig, tcfg: TrainConfig, local_producers: bool
) -> tuple[PipelineConfig, TrainConfig]:
    """This rank's settings, checked: under torchrun this process is rank r of R: it binds port + 2r, and
    its producers get that rank's share, port and metrics ports (per_rank, which the trainer applies too)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world <= 1 and (cfg.world_size > 1 or cfg.rank > 0):  # it trained rank 0's share of the corpus alone
        raise SettingsError(
            f"--rank/--world-size {cfg.rank}/{cfg.world_size} name ranks of a torchrun job, and this trainer runs "
            f"without torchrun (one rank): start it with `torchrun --nproc-per-node {cfg.world_size} -m lmpipe "
            "...` and leave them out, or leave them out to train on the whole corpus here"
        )
    rank_cfg, rank_tcfg = per_rank(cfg, tcfg, rank, world) if world > 1 else (cfg, tcfg)
    check_ports(rank_cfg)
    mix = cfg.mixture()  # a mixture has --shards shards a source
    shards = rank_tcfg.shards * (len(mix.sources) if mix is not None else 1)
    if local_producers and rank_cfg.producers > shards:  # forked, each idle: thousands hung the run
        raise SettingsError(
            f"--producers {cfg.producers}: more than the {shards} shards the corpus is split into "
            f"(--shards{', for each source of the mixture' if mix is not None else ''}), and a producer without a "
            "shard only stands by; "
            + (
                f"give --shards {rank_cfg.producers} too, or fewer producers"
                if rank_cfg.producers <= 4096
                else "at most 4096 (as many as --shards can be)"
            )
        )
    if local_producers and (mp := rank_tcfg.metrics_port) and mp > 0 and mp + rank_cfg.producers > 65535:
        raise SettingsError(  # producer i serves its metrics on port + 1 + i: bind() failed in each of them
            f"--metrics-port {tcfg.metrics_port}: its {rank_cfg.producers} producers would serve on ports up to "
            f"{mp + rank_cfg.producers}, past 65535; give a lower --metrics-port (0: any free port, -1: off)"
        )
    return rank_cfg, rank_tcfg


def check_inputs(cfg: PipelineConfig, tcfg: TrainConfig, local_producers: bool) -> CorpusFacts:
    """The tokenizer, and the corpus where this process knows it (`run`, or `train --data`)."""
    tok = check_tokenizer(cfg)
    if tcfg.vocab_size and tcfg.vocab_size < tok.vocab_size:  # the trainer checks too (after torch loads)
        raise SettingsError(
            f"--vocab-size {tcfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size}"
        )
    check_model_folder(cfg, tcfg, tok.vocab_size)
    check_held_out(cfg, tcfg, tok)  # read; tokenized after the producers are forked (lmpipe/evaldata.py)
    facts = CorpusFacts()
    facts.inputs += [("the --eval-data file", p) for p in tcfg.eval_data if os.path.isfile(p)]
    if cfg.tokenizer and os.path.isfile(cfg.tokenizer):
        facts.inputs.append(("the --tokenizer", cfg.tokenizer))
    # `lmpipe train --data X` trains on X, not on what a producer serves
    mix = cfg.mixture()
    if not (local_producers or cfg.data or mix):
        return facts
    try:
        corpora = check_corpus(cfg, tok)
    except SettingsError as exc:
        if local_producers:
            raise
        if mix is not None:  # the sources may be on the producers' hosts only: the first producer pins them
            log.info("%s; the trainer reads the mixture's weights, and the producers its data", exc)
            return facts
        raise SettingsError(
            f"{exc} (the trainer opens its --data to refuse producers of another corpus; where the corpus "
            "is only on the producers' hosts, leave --data off the trainer)"
        ) from None
    if tcfg.resume:
        check_resume_corpus(corpora, tcfg)
    facts.data, facts.content = corpora.fingerprint(), corpora.content_digest()
    facts.versions, facts.objects = corpora.version_digest(), corpora.object_versions()
    facts.inputs += [
        ("the --data file", f.path) for c in corpora.corpora for f in c.paths if f.remote is None
    ]
    return facts


def check_outputs(
    cfg: PipelineConfig,
    tcfg: TrainConfig,
    opts: ReportOptions,
    inputs: list[tuple[str, str]],
    lock: bool = True,
) -> None:
    """The device, and the places the run writes: checkpoints (locked for this run, unless not `lock`: a
    dry run makes no folder), doc-log, summary."""
    check_device(tcfg.device)
    check_writable("--checkpoint-dir", tcfg.checkpoint_dir, directory=True)
    if tcfg.checkpoint_dir and (Path(tcfg.checkpoint_dir) / "header.json").is_file():
        raise SettingsError(
            f"--checkpoint-dir {tcfg.checkpoint_dir} is one checkpoint; give the folder that holds it "
            f"(--resume {tcfg.checkpoint_dir} resumes from this one)"
        )
    if lock:
        lock_checkpoint_dir(tcfg)
    check_not_overwritten(tcfg)
    if not tcfg.checkpoint_dir and (tcfg.resume or tcfg.checkpoint_every):  # worked on, then lost at the end
        given = f"--resume {tcfg.resume}" if tcfg.resume else f"--checkpoint-every {tcfg.checkpoint_every}"
        log.warning("%s without --checkpoint-dir: this run writes no checkpoint, and its steps are lost "
                    "when it ends; give --checkpoint-dir to keep them", given)  # fmt: skip
    check_writable("--doc-log", tcfg.doc_log)
    check_not_read_back("--doc-log", tcfg.doc_log, cfg.all_data())
    check_writable("--summary-json", opts.summary_json)
    if why := missing_package(tcfg.log_to):  # an optional extra (consumer/sinks.py)
        raise SettingsError(why)
    for spec in tcfg.log_to:
        check_writable(
            "--log-to", spec.partition(":")[2] if spec.startswith("tensorboard:") else "", directory=True
        )
    check_not_an_input([("--doc-log", tcfg.doc_log), ("--summary-json", opts.summary_json)], inputs)


def run_trainer(
    cfg: PipelineConfig,
    tcfg: TrainConfig,
    opts: ReportOptions,
    facts: CorpusFacts,
    procs: list[LocalProducer],
    live: LiveLine | None = None,
) -> int:
    """Build the trainer, train, report; reap the local producers whatever happens."""
    try:
        from lmpipe.consumer.trainer import Trainer

        trainer = Trainer(
            cfg, tcfg, data=facts.data, data_content=facts.content, data_versions=facts.versions,
            data_objects=facts.objects, eval_batches=held_out(cfg, tcfg),
        )  # fmt: skip
    except BaseException:
        for p in procs:
            p.kill()
        reap(procs)
        raise
    stop_on_signals(trainer)
    if procs:
        log.info("started %d producer process(es): pids %s", len(procs), " ".join(str(p.pid) for p in procs))

        def producers_alive() -> str | None:
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    return f"producer {i} exited with code {p.returncode}"
            return None

        trainer.health_check = producers_alive
    try:
        if live is not None:
            live.attach(lambda: trainer.step)
        summary = trainer.run(progress=live.interval if live is not None else plain_progress(tcfg.steps))
        if live is not None:
            live.finish()  # the line ended before the summary
        if trainer.dist.is_main:  # under torchrun, rank 0 reports for the job
            report(summary, opts.summary_json)
        if not trainer.interrupted:
            linger(opts.metrics_linger)  # local producers linger as long, side by side
    finally:
        if trainer.restarting:  # not told to stop (Trainer.run): they would wait for the restarted rank
            for p in procs:
                p.terminate()
        reap(procs)
    if any(p.returncode not in (0, -signal.SIGTERM) for p in procs):
        log.error("producer exit codes: %s", [p.returncode for p in procs])
        return 1
    # a scheduler or script must not take a run that stopped on a problem (--wait-timeout) for one that ended
    return 1 if trainer.failure else 0
