"""The trainer process: the step loop on the main thread, the receive thread beside it.

Per step: take `accum` ready host slots from the pipeline (the wait is data-wait time; consumer/pipeline.py,
the same receive side the library's Loader uses),
run forward/backward over them and one optimizer step (consumer/step.py, on what consumer/build.py built),
count, report at each logging interval (consumer/runstats.py), and checkpoint when due. The host reads GPU
values (loss, grad norm, loss scale) only every `log_every` steps, one step late (runstats.REPORT_BEHIND);
nothing else in the loop synchronises.
With --consume-only no model is built: a step is the copy of its batches to the device (how fast the
pipeline alone can feed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from lmpipe.consumer import reshard, startup
from lmpipe.consumer.build import build
from lmpipe.consumer.checkpoint import (
    NO_MODEL,
    CheckpointManager,
    ReadAhead,
    load,
    read_header,
    resolve_resume,
)
from lmpipe.consumer.checkpoint_async import CheckpointWriter
from lmpipe.consumer.config import TrainConfig, per_rank
from lmpipe.consumer.distributed import from_env
from lmpipe.consumer.evaluate import Evaluator
from lmpipe.consumer.feed import DeviceFeed
from lmpipe.consumer.hf import model_identity
from lmpipe.consumer.inputs import empty_inputs
from lmpipe.consumer.model import GPT
from lmpipe.consumer.pipeline import Pipeline
from lmpipe.consumer.receiver import Receiver
from lmpipe.consumer.report import Announce, Summary
from lmpipe.consumer.resume import restore
from lmpipe.consumer.runstats import CompiledGraphs, Progress, RunStats, TrainingDiverged
from lmpipe.consumer.scaler import LossScaler
from lmpipe.consumer.sinks import NO_SINKS, Sinks
from lmpipe.consumer.step import lr_at, resolve_device, resolve_precision
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.security import check_bind
from lmpipe.shared.sockets import endpoints
from lmpipe.shared.tokenizer import load_tokenizer

log = logging.getLogger("lmpipe.trainer")


class Trainer:
    sinks: Sinks = NO_SINKS  # --log-to's, from start() on

    def __init__(
        self, pcfg: PipelineConfig, tcfg: TrainConfig, *, data: str = "", data_content: str = "",
        data_versions: str = "", data_objects: dict[str, str] | None = None, eval_batches: list | None = None,
    ):  # fmt: skip
        """`data`, `data_content` and `data_versions`: the corpus the producers must serve (Corpus.fingerprint,
        content_digest and version_digest), where the user named it (lmpipe/launch.py); "": the first producer
        pins it. A resumed checkpoint's own "data" and "data_content" override them; its "data_versions" join
        them. `data_objects`: each remote object's version (Corpus.object_versions), kept in checkpoints so that
        a refused resume names a rewritten object (lmpipe/checks.py). `eval_batches`: consumer/evaluate.py."""
        self._startup = startup.Startup()  # the compile cache, the compile ahead, the time to the first step
        check_bind(pcfg.host, pcfg.trusted_network, pcfg.curve_dir)
        self.dist = from_env(tcfg.device)
        if self.dist.enabled:
            pcfg, tcfg = per_rank(pcfg, tcfg, self.dist.rank, self.dist.world_size)
        endpoints(pcfg)  # an unsafe runtime directory fails here, before the model is built
        tcfg = self._plan(pcfg, tcfg)
        self.pcfg, self.cfg = pcfg, tcfg
        if tcfg.threads > 0:
            torch.set_num_threads(tcfg.threads)
        torch.manual_seed(tcfg.seed)
        self.device = resolve_device(tcfg.device, self.dist.local_rank if self.dist.enabled else None)
        self.precision, self.autocast_dtype = resolve_precision(tcfg.precision, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
            torch.backends.cudnn.allow_tf32 = tcfg.tf32
        self.tok = load_tokenizer(pcfg.tokenizer, pcfg.data)  # facts from shards, if prepared with it
        if tcfg.vocab_size and tcfg.vocab_size < self.tok.vocab_size:
            raise ValueError(
                f"--vocab-size {tcfg.vocab_size} is smaller than the tokenizer's {self.tok.vocab_size}"
            )
        self.model: GPT | None = None  # None: --consume-only, the pipeline alone
        self.scaler: LossScaler | None = None
        self._published = (0.0, 0.0)  # scaler overflow/skip counts already added to the metrics
        self._graphs = CompiledGraphs()  # before the model is built
        if not tcfg.consume_only:
            built = build(
                pcfg, tcfg, self.tok.vocab_size, self.device, self.precision, self.autocast_dtype, self.dist
            )
            self.model, self.optimizer, self.scaler = built.model, built.optimizer, built.scaler
            self.step_model, self.runner = built.step_model, built.runner
            self._startup.built(pcfg, tcfg, built, self.dist, self.tok.vocab_size)
        self.pipe = Pipeline(
            pcfg, self.tok, self.device, shards=self.layout.count, slots=tcfg.slots or 2 * tcfg.accum + 2,
            copy_stream=tcfg.copy_stream, attention=tcfg.attention, wait_timeout=tcfg.wait_timeout,
            metrics_port=tcfg.metrics_port, doc_log=tcfg.doc_log, data=data, data_content=data_content,
            data_versions=data_versions, layout=self.layout.wire(),
        )  # fmt: skip
        self.metrics, self.mask_cache, self.session = (
            self.pipe.metrics,
            self.pipe.mask_cache,
            self.pipe.session,
        )
        self.table, self.slots, self.fingerprint = self.pipe.table, self.pipe.slots, self.pipe.fingerprint
        self.evaluator = None if self.model is None or not eval_batches else Evaluator(
            eval_batches, tcfg.eval_every, self.model, self.runner._autocast, self.device, tcfg.attention,
            self.mask_cache, self.metrics)  # fmt: skip
        self.step = 0
        self.data_objects = dict(data_objects or {}) if data else {}  # per object (header "data_objects")
        self.checkpoints = (
            CheckpointManager(tcfg.checkpoint_dir, tcfg.keep_checkpoints) if tcfg.checkpoint_dir else None
        )
        self.writer = (  # rank 0 writes
            CheckpointWriter(self.checkpoints, tcfg.checkpoint_mode, self.device, self.metrics)
            if self.checkpoints
            else None
        )
        self._resume(tcfg, "" if tcfg.consume_only else built.fast_line)
        self._stop_reason = ""
        self.restarting = False  # a rank was lost and torchrun restarts the job (run())
        self.failure: str | None = None  # why the run stopped on a problem (the command then exits 1)
        self.health_check: Callable[[], str | None] | None = None  # a reason to stop (e.g. a dead producer)
        self.metrics.info.info(
            {
                "model": tcfg.model,
                "params": str(self.num_params),
                "device": str(self.device),
                "precision": self.precision,
                "strategy": pcfg.strategy,
            }
        )

    def _plan(self, pcfg: PipelineConfig, tcfg: TrainConfig) -> TrainConfig:
        """The checkpoint to resume, if any: its header decides this rank's shards (consumer/reshard.py) and,
        with --keep-global-batch, --accum. The rank and world size are `pcfg`'s (torchrun's: per_rank)."""
        self.resume_path = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
        header = read_header(self.resume_path) if self.resume_path is not None else None
        # state.pt read while the model is built (load() takes it at _resume, after the header's checks)
        self._ahead = ReadAhead(self.resume_path, header) if self.resume_path and header is not None else None
        self.layout = reshard.plan(header, pcfg.rank, pcfg.world_size, tcfg.shards, self.resume_path)
        return reshard.global_batch(self.layout, tcfg, self.resume_path)

    # the pipeline's corpus pins, as resume.restore and save_checkpoint read and set them
    @property
    def data_content(self) -> str:
        return self.pipe.data_content

    @data_content.setter
    def data_content(self, value: str) -> None:
        self.pipe.data_content = value

    @property
    def data_versions(self) -> list[str]:
        return self.pipe.data_versions

    @data_versions.setter
    def data_versions(self, value: list[str]) -> None:
        self.pipe.data_versions = value

    @property
    def receiver(self) -> Receiver | None:
        return self.pipe.receiver

    @property
    def feed(self) -> DeviceFeed:
        return self.pipe.feed

    @property
    def num_params(self) -> int:
        return self.model.num_params() if self.model is not None else 0

    # -- checkpoints ---------------------------------------------------------------------------------

    def _identity(self) -> dict:
        """What a checkpoint must match to be resumed by this run."""
        return {
            # a --consume-only checkpoint holds cursors only: a model run must not resume from it, nor it from one
            "model": model_identity(self.model) if self.model is not None else NO_MODEL,
            "tokenizer": self.tok.hash,
            "vocab_size": self.tok.vocab_size,
            # every rank's cursors are in the checkpoint: it must match the world size, not the rank
            "stream": replace(self.pcfg, rank=0).stream_fields(),
            "shards": self.cfg.shards,  # the split; how many producers serve it may change
            "precision": self.precision,
        }

    def save_checkpoint(self) -> Path | None:
        """Every rank calls this at the same step; rank 0 writes, with every rank's producer cursors (async:
        rank 0 copies the state to host memory and starts its write; the folder it will have is returned)."""
        if self.writer is None:
            return None
        if self.device.type == "cuda" and not self.writer.background:
            torch.cuda.synchronize()
        by_rank = self.dist.gather(self.pipe.state_dict())
        if not self.dist.is_main:  # rank 0 writes, then says whether it could: a failure stops every rank
            if not self.dist.broadcast(None):
                raise OSError("rank 0 could not write the checkpoint (its log says why)")
            return None
        try:
            self.writer.save(self.step, self._checkpoint_header(), self._checkpoint_state(by_rank))
        except OSError:
            self.dist.broadcast(False)
            raise
        self.dist.broadcast(True)
        return self.writer.manager.path(self.step)

    def _checkpoint_state(self, by_rank: list[Any] | None) -> dict[str, Any]:
        """state.pt: the live state (an async save copies it before training goes on). One entry per part;
        what decides the data trained next (the cursors, "workers") sits beside the others as an entry of
        its own."""
        state: dict[str, Any] = {
            "model": self.model.state_dict() if self.model is not None else {},
            "optimizer": self.optimizer.state_dict() if self.model is not None else {},
            "step": self.step,
            "workers": by_rank,  # per rank, per producer: cursor and last sequence number
            "rng": {"torch": torch.get_rng_state()},
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _checkpoint_header(self) -> dict[str, Any]:
        return {
            **self._identity(),
            "session": self.session,
            "data": self.fingerprint.get("data", ""),
            # the files' contents as pinned (receiver.py); "" (unchecked: built-in corpus, shards, remote files)
            # is left out, as checkpoints before it left it out
            **({"data_content": content} if (content := self._data_content()) else {}),
            # remote objects' versions as pinned, one per location; left out where none (older checkpoints)
            **({"data_versions": versions} if (versions := self._data_versions()) else {}),
            # each object's version, per location, to name a rewritten one (lmpipe/checks.py); left out where none
            **({"data_objects": self.data_objects} if self.data_objects else {}),
            **reshard.header_fields(self.layout, self.cfg.accum),  # the global shards, read back at resume
        }

    def _resume(self, tcfg: TrainConfig, fast_line: str) -> None:
        """Resume from --resume's checkpoint, if there is one; then say which fast paths run (after the
        checkpoint's checks, so that a refused checkpoint stays one line)."""
        if self.resume_path is not None:
            restore(self, load(self.resume_path, self._identity(), self._ahead))
            self._ahead = None  # the state is the model's and the optimizer's now: no second copy kept
        elif tcfg.resume:
            log.info("--resume %s: no checkpoint in %s yet; starting fresh", tcfg.resume, tcfg.checkpoint_dir)
        reshard.said(self.layout, tcfg.accum, self.pcfg.batch_size, self.metrics, self.dist.is_main,
                     self.dist.restarts)  # fmt: skip
        if fast_line:
            log.info("%s", fast_line)

    def _data_content(self) -> str:
        return self.pipe.pinned_data_content()  # pinned from the first producer that says it

    def _data_versions(self) -> list[str]:
        return self.pipe.pinned_data_versions()

    def request_stop(self, reason: str = "signal") -> None:
        self._stop_reason = reason

    @property
    def interrupted(self) -> bool:
        return bool(self._stop_reason)

    # -- the loop ------------------------------------------------------------------------------------

    def start(self) -> None:
        # one batch shape per compiled graph, and for the step's CUDA graphs (a short last batch stepped
        # eagerly beside them would need a second step's activations)
        fixed_rows = self.cfg.compile or (self.model is not None and self.runner.graphs)
        self.pipe.health_check = self.health_check
        self.pipe.start(rows=self.pcfg.batch_size if fixed_rows else None)
        port = self.pipe.metrics_bound
        log.info(
            "training %s on %s (%s), %.2fM params; listening on %s; %d shards for any number of producers%s",
            "no model (--consume-only)" if self.model is None else self.cfg.model,
            self.device,
            self.precision,
            self.num_params / 1e6,
            self.pipe.describe(),
            self.cfg.shards,
            f"; metrics on :{port}" if port else "",
        )
        self._startup.warm_up()  # while producers connect: the compile cache, the compile ahead
        self.sinks = Sinks(self.cfg.log_to, {"pipeline": asdict(self.pcfg), "train": asdict(self.cfg)},
                           self.dist.is_main)  # fmt: skip
        if self.evaluator is not None:
            self.evaluator.sinks = self.sinks

    def run(self, progress: Progress | None = None) -> Summary:
        """Train until `steps`, the end of the data, or request_stop(). `progress(step, stats)` is called
        at every logging interval (the CLI draws its status line with it)."""
        self._started = time.perf_counter()
        self.start()
        try:
            summary = self._run(progress)
            self.pipe.stop(self._stop_reason or "training finished")
            # the producers' byes carry their final counts; rank 0 adds up every rank's
            assert self.receiver is not None
            for counts in self.dist.gather(dict(self.receiver.skipped)) or []:
                for reason, n in counts.items():
                    summary.skipped[reason] = summary.skipped.get(reason, 0) + n
            summary.mixture = self.pipe.mixture()
            return summary
        except Exception as exc:  # the producers are told why, not "training finished"
            why = (
                "training diverged"
                if isinstance(exc, TrainingDiverged)
                else f"the trainer failed ({type(exc).__name__})"
            )
            self._stop_reason = self._stop_reason or why
            if (lost := self.dist.lost(exc)) is not None:  # said in one line, not gloo's traceback
                # torchrun starts the job again: producers on other hosts are not told to stop, they hold
                # their batches until the restarted rank welcomes them (its own, forked, die with it)
                self.restarting = self.dist.will_restart()
                raise lost from None
            raise
        finally:
            if self.writer is not None and self.dist.is_main:  # none is left in flight after _run
                self.writer.abandon(self._stop_reason or "training finished")
            self.pipe.stop("" if self.restarting else self._stop_reason or "training finished")
            self.sinks.close()
            self.dist.close()

    def _run(self, progress: Progress | None) -> Summary:
        cfg, m = self.cfg, self.metrics
        flops_per_token = self.model.flops_per_token(self.pcfg.seq_len) if self.model is not None else 0.0
        stats = RunStats(
            cfg, self.dist, m, self.feed, self.device, self.scaler, self._published, flops_per_token,
            trained=self.model is not None, started=self._started, step=self.step,
        )  # fmt: skip
        stats.summary.topology = reshard.summary(self.layout, self.dist.restarts)
        stats.sinks = self.sinks
        try:
            self._loop(stats, progress)
        except BaseException:
            # the interval closed before the error is said first, as it was when it closed (not under
            # torchrun: the report exchanges host scalars with ranks that may not be here)
            if not self.dist.enabled:
                with suppress(Exception):
                    stats.report()
            raise
        stats.close_tail(self.step)
        if self.evaluator is not None:  # at the end too, unless the last step was just evaluated
            self.evaluator.maybe(self.step, stats.summary, end=True, is_main=self.dist.is_main)
        self._startup.save(self.step)  # graphs compiled after the first step, if any
        # at the end, and after SIGTERM/SIGINT once the current step is done (rank 0 decides for all)
        if self.dist.broadcast(self.writer is not None and self.step and not self.writer.holds(self.step)):
            stats.check_finite(self.step)
            self.save_checkpoint()
        if self.writer is not None:  # a write still in flight is waited for (and said)
            self.writer.finish_all(self.dist, self._stop_reason or "training finished")
        assert self.receiver is not None
        return stats.finish(self.step, self._stop_reason, self._graphs, self.receiver.native_id)

    def _loop(self, stats: RunStats, progress: Progress | None) -> None:
        """Steps until the step limit, the end of the data or a stop."""
        cfg, m = self.cfg, self.metrics
        no_loss = torch.zeros((), device=self.device)  # --consume-only: nothing is trained
        while not self._stop_reason and (cfg.steps == 0 or self.step < cfg.steps):
            stats.report(wait=False)  # the last interval, if its step is done: the wait for data may be long
            slots, waited, problem = self.pipe.take(cfg.accum, stopping=lambda: bool(self._stop_reason))
            if problem:
                log.error("%s; stopping", problem)
                self._stop_reason = self.failure = problem
            metas = [s.meta for s in slots if s.meta is not None]  # taken slots are always filled
            n_targets = sum(m.n_targets for m in metas)
            # ranks step together: on the targets of all of them, while any has data, until any stops
            all_targets, any_data, any_stop = self.dist.agree(n_targets, bool(slots), bool(self._stop_reason))
            if any_stop and not self._stop_reason:
                self._stop_reason = "another rank stopped"
            if not any_data:
                stats.waited_for_nothing(waited)
                break
            waited = stats.start_clock(waited)
            t0 = time.perf_counter()
            self.pipe.log_docs(self.step, metas)
            lr = lr_at(self.step, cfg)
            first = stats.first
            if self.model is None:  # --consume-only: the copy to the device is the whole step
                for s in slots:
                    self.pipe.copy(s)
                loss_sum = norm = no_loss
            elif all_targets == 0:  # every rank agrees: nothing to learn here, and no update to make
                stats.skip_untrained(slots, self.pipe, self.step)
                loss_sum = norm = no_loss
            else:
                micro = [self.pipe.to_device(s) for s in slots]
                if not micro:  # this rank's producers are done, others' are not: a step on nothing
                    micro = [empty_inputs(self.pcfg, self.device, cfg.attention, self.mask_cache)]
                # torch.compile traces and compiles in the first step: minutes on a large model, said as it goes
                with (
                    Announce("compiling the model (torch.compile, first step)", log)
                    if first and cfg.compile and not self._startup.ahead
                    else nullcontext()
                ):
                    loss_sum, norm = self.runner.step(micro, all_targets / self.dist.world_size, lr)
            self.step += 1
            m.global_step.set(self.step)
            m.last_step_time.set(time.time())
            if first:
                stats.first_step_done()
                self._startup.first_step_done(stats.summary, stats.run_start, cfg.compile and self.model is not None,
                                              self.step, say=self.dist.is_main)  # fmt: skip
            stats.add_step(metas, loss_sum, waited, lr)
            self.pipe.release_done()
            m.step_seconds.observe(time.perf_counter() - t0 + waited)
            stats.report()  # the last interval, now that this step is queued behind it (REPORT_BEHIND)
            if cfg.compile:
                self._graphs.count(m)
            if self.writer is not None and not self.dist.enabled:
                # a background write that failed stops the run here, as a synchronous one would have; under
                # torchrun only rank 0 knows: the next checkpoint or the run's end stops every rank
                self.writer.check()
            if (
                cfg.checkpoint_every
                and self.step % cfg.checkpoint_every == 0
                and self.checkpoints is not None
            ):
                stats.check_finite(self.step)  # a diverged model is not written over the good ones
                self.save_checkpoint()
            if stats.due(self.step):
                stats.close_interval(self.step, lr, norm, progress)
            if self.evaluator is not None:
                self.evaluator.maybe(self.step, stats.summary, is_main=self.dist.is_main)
