"""The trainer process: the step loop on the main thread, the receive thread beside it.

Per step: take `accum` ready host slots from the device feed (the wait is data-wait time; consumer/feed.py),
run forward/backward over them and one optimizer step (consumer/step.py), count and log
(consumer/report.py), and checkpoint when due. The host reads GPU values (loss, grad norm, loss scale)
only every `log_every` steps; nothing else in the loop synchronises. With --consume-only no model is
built: a step is the copy of its batches to the device (how fast the pipeline alone can feed).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lmpipe.consumer.checkpoint import NO_MODEL, CheckpointError, CheckpointManager, load, resolve_resume
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import from_env
from lmpipe.consumer.feed import DeviceFeed
from lmpipe.consumer.inputs import MaskCache, ModelInputs, build_inputs
from lmpipe.consumer.model import GPT, fused_linear_cross_entropy, preset
from lmpipe.consumer.receiver import Receiver, WorkerTable
from lmpipe.consumer.report import Announce, Summary, format_loss, peak_flops, thread_cpu_seconds
from lmpipe.consumer.scaler import LossScaler, make_scaler
from lmpipe.consumer.slots import HostSlot, SlotMeta
from lmpipe.consumer.step import (
    StepRunner,
    lr_at,
    make_optimizer,
    resolve_device,
    resolve_precision,
    to_float8,
)
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.metrics import TrainerMetrics, serve
from lmpipe.shared.security import check_bind
from lmpipe.shared.sockets import endpoints
from lmpipe.shared.tokenizer import load_tokenizer

log = logging.getLogger("lmpipe.trainer")


class Trainer:
    def __init__(self, pcfg: PipelineConfig, tcfg: TrainConfig):
        check_bind(pcfg.host, pcfg.trusted_network, pcfg.curve_dir)
        self.dist = from_env(tcfg.device)
        if self.dist.enabled:
            pcfg, tcfg = self._per_rank(pcfg, tcfg)
        endpoints(pcfg)  # an unsafe runtime directory fails here, before the model is built
        self.pcfg, self.cfg = pcfg, tcfg
        if tcfg.threads > 0:
            torch.set_num_threads(tcfg.threads)
        torch.manual_seed(tcfg.seed)
        self.device = resolve_device(tcfg.device, self.dist.local_rank if self.dist.enabled else None)
        self.precision, self.autocast_dtype = resolve_precision(tcfg.precision, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
            torch.backends.cudnn.allow_tf32 = tcfg.tf32
        self.tok = load_tokenizer(pcfg.tokenizer)
        if tcfg.vocab_size and tcfg.vocab_size < self.tok.vocab_size:
            raise ValueError(
                f"--vocab-size {tcfg.vocab_size} is smaller than the tokenizer's {self.tok.vocab_size}"
            )
        self.model: GPT | None = None  # None: --consume-only, the pipeline alone
        self.scaler: LossScaler | None = None
        self._published = (0.0, 0.0)  # scaler overflow/skip counts already added to the metrics
        # torch.compile graphs counted so far; the counter is per process (benchmarks build several trainers)
        self._graphs = self._graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if not tcfg.consume_only:
            self._build_model(pcfg, tcfg)
        self.metrics = TrainerMetrics()
        self.metrics.producers_expected.set(pcfg.producers)
        for w in range(tcfg.shards):
            self.metrics.received.labels(str(w))
        self.mask_cache = MaskCache(
            on_hit=self.metrics.cache_hits.labels(MaskCache.name).inc,
            on_miss=self.metrics.cache_misses.labels(MaskCache.name).inc,
        )
        self.session = uuid.uuid4().hex[:12]
        self.table = WorkerTable(tcfg.shards)
        self.step = 0
        n_slots = tcfg.slots or 2 * tcfg.accum + 2
        pin = self.device.type == "cuda"
        dt = token_dtype(self.tok.vocab_size)
        self.slots = [HostSlot(pcfg.batch_size, pcfg.seq_len, dt, pin) for _ in range(n_slots)]
        self.fingerprint = fingerprint(pcfg, self.tok.hash, self.tok.vocab_size)
        self.checkpoints = (
            CheckpointManager(tcfg.checkpoint_dir, tcfg.keep_checkpoints) if tcfg.checkpoint_dir else None
        )
        resume_path = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
        if resume_path is not None:
            self._restore(load(resume_path, self._identity()))
        elif tcfg.resume:
            log.info("--resume %s: no checkpoint in %s yet; starting fresh", tcfg.resume, tcfg.checkpoint_dir)
        self._stop_reason = ""
        self.health_check: Callable[[], str | None] | None = (
            None  # optional callable: returns a reason to stop (e.g. a dead producer)
        )
        self.feed: DeviceFeed
        self._doc_log = open(tcfg.doc_log, "a") if tcfg.doc_log else None  # noqa: SIM115 - closed in run()
        self.metrics.info.info(
            {
                "model": tcfg.model,
                "params": str(self.num_params),
                "device": str(self.device),
                "precision": self.precision,
                "strategy": pcfg.strategy,
            }
        )

    @property
    def num_params(self) -> int:
        return self.model.num_params() if self.model is not None else 0

    def _build_model(self, pcfg: PipelineConfig, tcfg: TrainConfig) -> None:
        """The GPT, its optimizer and loss scaler, DDP and compile wrappers, and the step runner."""
        mcfg = preset(
            tcfg.model, vocab_size=max(tcfg.vocab_size, self.tok.vocab_size), block_size=pcfg.seq_len
        )
        self.model = model = GPT(mcfg).to(self.device)
        model.grad_checkpointing = tcfg.grad_checkpointing
        if self.precision == "fp8":
            log.info("fp8: %d linear layers use torchao float8 matmuls", to_float8(model))
        if tcfg.fused_ce and self.device.type == "cuda":
            model.fused_ce = fused_linear_cross_entropy()
            if model.fused_ce is None:
                log.warning(
                    "--fused-ce: liger-kernel is not installed (pip install 'lmpipe[fused]'); plain loss"
                )
        self.optimizer = make_optimizer(model, tcfg, self.device)
        self.scaler = make_scaler(tcfg.loss_scale, self.device) if self.precision == "fp16" else None
        if self.scaler is not None and not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            log.warning("fp16 with a non-fused optimizer: the scaler reads found_inf on the host every step")
        self.step_model: torch.nn.Module = model
        no_sync = None
        if self.dist.enabled:
            # 100 MB buckets: compiled under DDP, the graph is split at every bucket (DDPOptimizer, so that the
            # all-reduce overlaps backward); fewer splits kept more fusion. GPT-2 124M on 4 H100s, 2 ranks:
            # 0.945 of 2x one GPU vs 0.919 at the default 25 MB (bench/results/ddp-*.md).
            ddp = DistributedDataParallel(
                model,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                bucket_cap_mb=100,
                gradient_as_bucket_view=True,
            )
            if tcfg.grad_reduce == "bf16":
                if self.device.type != "cuda":  # torch's hook needs NCCL
                    raise ValueError("--grad-reduce bf16 needs CUDA GPUs (NCCL); on CPU leave it at fp32")
                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            self.step_model, no_sync = ddp, ddp.no_sync
        if tcfg.compile and pcfg.strategy in ("bucket", "pad-batch") and pcfg.pad_multiple == 1:
            log.warning("--compile with --strategy %s: every row width is a new graph; "
                        "bound them with --pad-multiple (e.g. 64)", pcfg.strategy)  # fmt: skip
        if tcfg.compile:
            # one graph per row width: pack/pad have one, bucket/pad-batch as many as --pad-multiple allows
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            mode = None if tcfg.compile_mode == "default" else tcfg.compile_mode
            self.step_model = cast(torch.nn.Module, torch.compile(self.step_model, dynamic=False, mode=mode))
        self.runner = StepRunner(
            self.step_model, self.optimizer, tcfg, self.autocast_dtype, self.scaler, no_sync=no_sync
        )

    def _per_rank(self, pcfg: PipelineConfig, tcfg: TrainConfig) -> tuple[PipelineConfig, TrainConfig]:
        """Rank r of R (torchrun) binds port + 2r, serves metrics after the lower ranks' trainer and
        producers, logs its documents to its own file, and expects producers of rank r."""
        r, world = self.dist.rank, self.dist.world_size
        if pcfg.world_size not in (1, world) or (pcfg.world_size == world and pcfg.rank not in (0, r)):
            raise ValueError(
                f"--rank/--world-size {pcfg.rank}/{pcfg.world_size} disagree with torchrun's {r}/{world}; "
                "leave them out under torchrun"
            )
        pcfg = replace(pcfg, rank=r, world_size=world, port=pcfg.port + 2 * r)
        metrics = tcfg.metrics_port
        if metrics:  # 0 (any free port) and -1/None (off) stay as they are
            metrics += r * (pcfg.producers + 1)
        doc_log = tcfg.doc_log
        if doc_log:
            path = Path(doc_log)
            doc_log = str(path.with_name(f"{path.stem}.rank{r}{path.suffix}"))
        return pcfg, replace(tcfg, metrics_port=metrics, doc_log=doc_log)

    # -- checkpoints ---------------------------------------------------------------------------------

    def _identity(self) -> dict:
        """What a checkpoint must match to be resumed by this run."""
        return {
            # a --consume-only checkpoint holds cursors only: a model run must not resume from it, nor it from one
            "model": asdict(self.model.config) if self.model is not None else NO_MODEL,
            "tokenizer": self.tok.hash,
            "vocab_size": self.tok.vocab_size,
            # every rank's cursors are in the checkpoint: it must match the world size, not the rank
            "stream": replace(self.pcfg, rank=0).stream_fields(),
            "shards": self.cfg.shards,  # the split; how many producers serve it may change
            "precision": self.precision,
        }

    def save_checkpoint(self) -> Path | None:
        """Every rank calls this at the same step; rank 0 writes, with every rank's producer cursors."""
        if self.checkpoints is None:
            return None
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        by_rank = self.dist.gather(self.table.state_dict())
        if not self.dist.is_main:
            self.dist.barrier()  # rank 0 is writing
            return None
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
        header = {
            **self._identity(),
            "session": self.session,
            "data": self.fingerprint.get("data", ""),
        }
        path = self.checkpoints.save(self.step, header, state)
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        self.metrics.checkpointed(self.step, time.time())
        self.dist.barrier()
        return path

    def _restore(self, ck) -> None:
        st = ck.state
        if (self.scaler is None) != ("scaler" not in st):  # before anything is loaded
            raise CheckpointError(
                f"{ck.path}: precision differs (loss scaler {'absent' if self.scaler is None else 'present'} here)"
            )
        if self.model is not None:
            self.model.load_state_dict(st["model"])
            self.optimizer.load_state_dict(st["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(st["scaler"])
            self._published = self.scaler.counters()
        self.step = int(st["step"])
        # format 1 (lmpipe 0.1.0) held one rank's cursors; format 2 a list of them per rank
        by_rank = st["workers"] if ck.header["format_version"] >= 2 else [st["workers"]]
        self.table.load_state_dict(by_rank[self.dist.rank])
        torch.set_rng_state(st["rng"]["torch"])
        if "cuda" in st["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(st["rng"]["cuda"], self.device)
        if ck.header.get("data"):
            self.fingerprint["data"] = ck.header["data"]  # producers must serve the same corpus
        cursors = ", ".join(f"s{w.worker}@seq{w.last_seq}" for w in self.table.workers)
        log.info("resumed from %s: step %d, shard cursors %s", ck.path, self.step, cursors)
        self.metrics.global_step.set(self.step)
        self.metrics.checkpointed(self.step, Path(ck.path).stat().st_mtime)

    def request_stop(self, reason: str = "signal") -> None:
        self._stop_reason = reason

    @property
    def interrupted(self) -> bool:
        return bool(self._stop_reason)

    # -- the loop ------------------------------------------------------------------------------------

    def _log_docs(self, metas: list[SlotMeta]) -> None:
        assert self._doc_log is not None
        rows = []
        for m in metas:
            pieces = [[int(a), int(b), int(c)] for a, b, c in zip(m.doc_id, m.doc_start, m.doc_len)]
            rows.append(
                {
                    "worker": m.worker,
                    "seq": m.seq,
                    "session": m.session,
                    "docs": pieces,
                    "targets": m.n_targets,
                }
            )
        self._doc_log.write(json.dumps({"step": self.step, "batches": rows}) + "\n")
        self._doc_log.flush()

    def start(self) -> None:
        self.receiver = Receiver(
            self.pcfg,
            self.fingerprint,
            self.slots,
            self.table,
            self.metrics,
            self.session,
            self.tok.vocab_size,
        )
        self.receiver.start()
        self.receiver.bound.wait()
        self.feed = DeviceFeed(
            self.receiver,
            self.table,
            self.session,
            self.metrics,
            self.device,
            copy_stream=self.cfg.copy_stream,
            rows=self.pcfg.batch_size if self.cfg.compile else None,  # one batch shape per compiled graph
            attention=self.cfg.attention,
            mask_cache=self.mask_cache,
            wait_timeout=self.cfg.wait_timeout,
        )
        self.feed.health_check = self.health_check
        self.feed.check_receiver()
        port = serve(self.metrics.registry, self.cfg.metrics_port, self.pcfg.metrics_host)
        log.info(
            "training %s on %s (%s), %.2fM params; listening on %s; %d shards for any number of producers%s",
            "no model (--consume-only)" if self.model is None else self.cfg.model,
            self.device,
            self.precision,
            self.num_params / 1e6,
            self.receiver.endpoints.describe(),
            self.cfg.shards,
            f"; metrics on :{port}" if port else "",
        )

    def run(self, progress=None) -> Summary:
        """Train until `steps`, the end of the data, or request_stop(). `progress(step, stats)` is called
        at every logging interval (the CLI draws its status line with it)."""
        self._started = time.perf_counter()
        self.start()
        try:
            return self._run(progress)
        finally:
            self.receiver.stop(reason=self._stop_reason or "training finished")
            if self._doc_log:
                self._doc_log.close()
            self.dist.close()

    def _run(self, progress) -> Summary:
        cfg, m = self.cfg, self.metrics
        summary = Summary()
        loss_acc = torch.zeros((), device=self.device)
        targets_acc = 0
        interval_tokens = 0
        interval_wait = 0.0
        interval_start = None
        run_start = None
        interval_step = self.step
        steady_start: tuple[float, int] | None = None  # (time, tokens) at the end of the first interval
        flops_per_token = self.model.flops_per_token(self.pcfg.seq_len) if self.model is not None else 0.0
        no_loss = torch.zeros((), device=self.device)  # --consume-only: nothing is trained
        batches = 0
        while not self._stop_reason and (cfg.steps == 0 or self.step < cfg.steps):
            slots, waited, problem = self.feed.take(cfg.accum, stopping=lambda: bool(self._stop_reason))
            if problem:
                log.error("%s; stopping", problem)
                self._stop_reason = problem
            metas = [s.meta for s in slots if s.meta is not None]  # taken slots are always filled
            n_targets = sum(m.n_targets for m in metas)
            # ranks step together: on the targets of all of them, while any has data, until any stops
            all_targets, any_data, any_stop = self.dist.agree(n_targets, bool(slots), bool(self._stop_reason))
            if any_stop and not self._stop_reason:
                self._stop_reason = "another rank stopped"
            if not any_data:
                break
            if run_start is None:  # the clock starts with the first batch, not with the producers' start-up
                run_start = interval_start = time.perf_counter()
                waited = 0.0
            t0 = time.perf_counter()
            real = sum(m.real_tokens for m in metas)
            batches += len(metas)
            pad = sum(m.pad_tokens for m in metas)
            if self._doc_log:
                self._log_docs(metas)
            lr = lr_at(self.step, cfg)
            first = math.isnan(summary.time_to_first_step)
            if self.model is None:  # --consume-only: the copy to the device is the whole step
                for s in slots:
                    self.feed.copy(s)
                loss_sum = norm = no_loss
            elif all_targets == 0:  # every rank agrees: nothing to learn here, and no update to make
                for s in slots:
                    self.receiver.release(s)  # never copied: free for the next batch at once
                loss_sum = norm = no_loss
                summary.untrained_steps += 1
                if summary.untrained_steps == 1 and self.dist.is_main:  # every rank skips: rank 0 says so
                    log.warning(
                        "step %d: no trained target in this step's batches (every token loss-masked); the "
                        "step is counted, the model is not updated (the summary says how often)",
                        self.step + 1,
                    )
            else:
                micro = [self.feed.to_device(s) for s in slots] or [self._empty_inputs()]
                # torch.compile traces and compiles in the first step: minutes on a large model, said as it goes
                with (
                    Announce("compiling the model (torch.compile, first step)", log)
                    if first and cfg.compile
                    else nullcontext()
                ):
                    loss_sum, norm = self.runner.step(micro, all_targets / self.dist.world_size, lr)
            self.step += 1
            m.global_step.set(self.step)
            m.last_step_time.set(time.time())
            if first:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # once: the first step's real end
                summary.time_to_first_step = time.perf_counter() - self._started
                m.first_step_seconds.set(summary.time_to_first_step)
            loss_acc += loss_sum
            targets_acc += n_targets
            interval_tokens += real
            interval_wait += waited
            summary.tokens += real
            summary.targets += n_targets
            summary.pad_tokens += pad
            summary.data_wait_seconds += waited
            m.tokens.inc(real)
            m.loss_tokens.inc(n_targets)
            m.padding.inc(pad)
            m.steps.inc()
            m.data_wait.observe(waited)
            m.lr.set(lr)
            self.feed.release_done()
            m.step_seconds.observe(time.perf_counter() - t0 + waited)
            if cfg.compile:
                self._count_compiles()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                # the one host sync of the interval (and, under torchrun, one exchange of host scalars)
                loss_all, targets_all, tokens_all = self.dist.sum(
                    [loss_acc.item(), targets_acc, interval_tokens]
                )
                if self.model is None:
                    loss = 0.0  # --consume-only: nothing is trained
                else:  # no trained target in the whole interval: no loss to show (0 would read as perfect)
                    loss = loss_all / targets_all if targets_all else math.nan
                now = time.perf_counter()
                assert interval_start is not None  # set with the first batch
                dt = now - interval_start
                stats = {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": float(norm),
                    "tokens_per_second": interval_tokens / dt if dt > 0 else 0.0,
                    "data_wait": interval_wait / dt if dt > 0 else 0.0,
                    "step_seconds": dt / max(self.step - interval_step, 1),
                    "step": self.step,
                    "elapsed": now - self._started,
                    "padding_efficiency": summary.padding_efficiency,
                    "mfu": 0.0,
                    "loss_scale": self.scaler.get_scale() if self.scaler else 1.0,
                }
                self._publish(stats, flops_per_token)
                if not math.isnan(loss):
                    summary.losses.append(loss)
                tok_s = tokens_all / dt if dt > 0 else 0.0  # every rank's
                summary.history.append({"step": self.step, "elapsed": stats["elapsed"], "loss": loss,
                                        "tokens_per_second": tok_s, "data_wait": stats["data_wait"]})  # fmt: skip
                if not self.dist.is_main:
                    pass  # rank 0 speaks for the job
                elif progress:
                    progress(self.step, {**stats, "tokens_per_second": tokens_all / dt if dt > 0 else 0.0})
                else:
                    log.info(
                        "step %d | loss %s | lr %.2e | %.0f tok/s | data wait %.1f%%",
                        self.step,
                        format_loss(loss),
                        lr,
                        stats["tokens_per_second"],
                        100 * stats["data_wait"],
                    )
                if steady_start is None:
                    steady_start = (now, summary.tokens)
                loss_acc.zero_()
                targets_acc = interval_tokens = 0
                interval_wait = 0.0
                interval_start, interval_step = now, self.step
        loss_all, targets_all = self.dist.sum([loss_acc.item(), targets_acc])
        if targets_all:  # the tail interval
            summary.losses.append(loss_all / targets_all)
        # at the end, and after SIGTERM/SIGINT once the current step is done (rank 0 decides for all)
        unsaved = self.checkpoints is not None and self.step and self.checkpoints.latest_step() != self.step
        if self.dist.broadcast(unsaved):
            self.save_checkpoint()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        summary.steps = self.step
        if steady_start is not None:
            summary.steady_seconds = end - steady_start[0]
            summary.steady_tokens = summary.tokens - steady_start[1]
        if self.dist.enabled:  # the summary speaks for the whole job
            summary.tokens, summary.pad_tokens, summary.steady_tokens, summary.targets = (
                int(v)
                for v in self.dist.sum(
                    [summary.tokens, summary.pad_tokens, summary.steady_tokens, summary.targets]
                )
            )
        peak = peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else 0.0
        if peak:  # per GPU
            summary.steady_mfu = (
                summary.steady_tokens_per_second / self.dist.world_size * flops_per_token / peak
            )
        summary.seconds = end - run_start if run_start else 0.0
        summary.first_loss = summary.losses[0] if summary.losses else float("nan")
        summary.last_loss = summary.losses[-1] if summary.losses else float("nan")
        summary.rejected, summary.stale, summary.refused = m.rejected_count, m.stale_count, m.refused_count
        summary.compiled_graphs = self._graphs - self._graphs_at_start
        if self.model is None:
            summary.consume = self._consume_stages(batches, summary.data_wait_seconds)
        if self._stop_reason:
            summary.stopped_by = self._stop_reason
        elif cfg.steps and self.step >= cfg.steps:
            summary.stopped_by = "step limit"
        else:
            summary.stopped_by = "end of data"
        return summary

    def _consume_stages(self, batches: int, waited: float) -> dict[str, float]:
        """--consume-only: seconds per batch in the receive thread (receive, decode, validate, fill a slot;
        its CPU time), in the copy to the device, and waiting for data."""
        self.feed.observe_h2d()
        n = max(batches, 1)
        out = {
            # the job's batches (the summary's tokens are the job's too); the times per batch are this rank's
            "batches": self.dist.sum([float(batches)])[0],
            "ranks": float(self.dist.world_size),
            "copy_seconds_per_batch": self.feed.h2d_seconds / n,
            "wait_seconds_per_batch": waited / n,
        }
        cpu = thread_cpu_seconds(self.receiver.native_id)
        if cpu is not None:
            out["receive_seconds_per_batch"] = cpu / n
            out["receive_busy"] = cpu / (time.perf_counter() - self._started)  # the thread's whole life
        return out

    def _empty_inputs(self) -> ModelInputs:
        """A batch with no targets, for a rank whose producers are done while other ranks still train:
        under DDP every rank must run the backward that all-reduces the gradients (it adds zeros)."""
        B, T = self.pcfg.batch_size, self.pcfg.seq_len
        tokens = torch.zeros(B, T, dtype=torch.long, device=self.device)
        lengths = torch.zeros(B, dtype=torch.int32, device=self.device)
        seg = (
            torch.zeros(B, T, dtype=torch.int32, device=self.device) if self.pcfg.strategy == "pack" else None
        )
        return build_inputs(tokens, lengths, seg, attention=self.cfg.attention, mask_cache=self.mask_cache)

    def _count_compiles(self) -> None:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if graphs > self._graphs:
            self.metrics.recompiles.inc(graphs - self._graphs)
            if self._graphs > self._graphs_at_start:
                log.info("torch.compile: %d graph(s) compiled so far", graphs - self._graphs_at_start)
            self._graphs = graphs

    def _publish(self, stats: dict, flops_per_token: float) -> None:
        m = self.metrics
        self.feed.observe_h2d()
        if not math.isnan(stats["loss"]):  # an interval without a trained target leaves the last loss
            m.loss.set(stats["loss"])
        m.grad_norm.set(stats["grad_norm"])
        m.loss_scale.set(stats["loss_scale"])
        if self.scaler is not None:
            overflows, skipped = self.scaler.counters()
            m.overflows.inc(overflows - self._published[0])
            m.skipped.inc(skipped - self._published[1])
            self._published = (overflows, skipped)
            stats["overflows"], stats["skipped"] = overflows, skipped
        if self.device.type == "cuda":
            m.gpu_memory.labels("allocated").set(torch.cuda.memory_allocated(self.device))
            m.gpu_memory.labels("reserved").set(torch.cuda.memory_reserved(self.device))
            m.gpu_memory.labels("peak").set(torch.cuda.max_memory_allocated(self.device))
            peak = peak_flops(torch.cuda.get_device_name(self.device))
            if peak:
                stats["mfu"] = stats["tokens_per_second"] * flops_per_token / peak
                m.mfu.set(stats["mfu"])
