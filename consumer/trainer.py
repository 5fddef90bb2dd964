"""The trainer process: step loop on the main thread, receive thread beside it.

Per step: take `accum` ready host slots (the wait is data-wait time), copy each to the GPU on a dedicated
copy stream, make the compute stream wait on the copy's event, run forward/backward for each micro-batch,
clip, step, and hand every slot back once its copy has finished. The host reads GPU values (loss, grad
norm, loss scale) only every `log_every` steps; nothing else in the loop synchronises.

Loss normalisation: the loss of a step is the sum of per-token losses over all its micro-batches divided by
the number of target tokens in all of them. That count is known on the host from the batch headers before
any backward pass, so N micro-batches with accumulation N give exactly the update of one N-times batch,
whatever the padding in each.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lmpipe.consumer.checkpoint import CheckpointError, CheckpointManager, load, resolve_resume
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.inputs import MaskCache, ModelInputs, build_inputs
from lmpipe.consumer.model import GPT, fused_linear_cross_entropy, preset
from lmpipe.consumer.receiver import EndOfStream, Receiver, WorkerTable
from lmpipe.consumer.scaler import LossScaler, make_scaler
from lmpipe.consumer.slots import HostSlot
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint, is_loopback
from lmpipe.shared.metrics import TrainerMetrics, serve
from lmpipe.shared.tokenizer import load_tokenizer

log = logging.getLogger("lmpipe.trainer")


@dataclass
class Summary:
    steps: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    seconds: float = 0.0
    data_wait_seconds: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    losses: list[float] = field(default_factory=list)
    rejected: int = 0
    stale: int = 0
    compiled_graphs: int = 0
    stopped_by: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_efficiency(self) -> float:
        total = self.tokens + self.pad_tokens
        return self.tokens / total if total else 0.0

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_second=self.tokens_per_second,
            padding_efficiency=self.padding_efficiency,
            data_wait_fraction=self.data_wait_fraction,
        )
        return d

    def render(self) -> str:
        return (
            f"summary: {self.steps} steps in {self.seconds:.1f} s ({self.stopped_by}) | "
            f"loss {self.first_loss:.3f} -> {self.last_loss:.3f} | "
            f"{self.tokens:,} tokens trained, {self.tokens_per_second:,.0f} tok/s | "
            f"padding efficiency {100 * self.padding_efficiency:.1f}% | "
            f"data wait {100 * self.data_wait_fraction:.1f}% | "
            f"dropped: {self.rejected} malformed, {self.stale} stale"
        )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr over lr_decay_steps (or `steps`)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    horizon = cfg.lr_decay_steps or cfg.steps
    if horizon <= cfg.warmup:
        return cfg.lr
    t = min(1.0, (step - cfg.warmup) / (horizon - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, decaying only matrices (nanoGPT's split), fused when asked and supported."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if cfg.fused_adamw:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError) as exc:  # e.g. a device without a fused kernel
            log.warning("fused AdamW unavailable (%s); using the foreach implementation", exc)
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


class StepRunner:
    """Forward/backward over a step's micro-batches and one optimizer step. Returns device tensors only."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        autocast_dtype,
        scaler: LossScaler | None = None,
    ):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.device_type = next(model.parameters()).device.type
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def step(self, micro: list[ModelInputs], n_targets: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (summed loss over all targets, grad norm before clipping)."""
        self.model.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        denom = float(max(n_targets, 1))
        loss_sum = torch.zeros((), device=micro[0].idx.device)
        for inp in micro:
            with self._autocast():
                _, loss = self.model(inp.idx, inp.pos, inp.attn, inp.targets)
            scaled = loss / denom
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().norm() for p in self.model.parameters() if p.grad is not None])
            )
        if self.scaler:
            self.scaler.step(self.optimizer)  # skipped on the device when gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    return dev


def resolve_precision(name: str, device: torch.device):
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    return name, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Trainer:
    def __init__(self, pcfg: PipelineConfig, tcfg: TrainConfig):
        if not is_loopback(pcfg.host) and not (pcfg.trusted_network or pcfg.curve_dir):
            raise ValueError(
                f"refusing to bind {pcfg.host}: not a loopback address and traffic is unencrypted; "
                "give CURVE keys (--curve-dir, made by `lmpipe keys`) or pass --trusted-network if this "
                "network is private"
            )
        self.pcfg, self.cfg = pcfg, tcfg
        if tcfg.threads > 0:
            torch.set_num_threads(tcfg.threads)
        torch.manual_seed(tcfg.seed)
        self.device = resolve_device(tcfg.device)
        self.precision, self.autocast_dtype = resolve_precision(tcfg.precision, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tcfg.tf32
            torch.backends.cudnn.allow_tf32 = tcfg.tf32
        self.tok = load_tokenizer(pcfg.tokenizer)
        if tcfg.vocab_size and tcfg.vocab_size < self.tok.vocab_size:
            raise ValueError(
                f"--vocab-size {tcfg.vocab_size} is smaller than the tokenizer's {self.tok.vocab_size}"
            )
        mcfg = preset(
            tcfg.model, vocab_size=max(tcfg.vocab_size, self.tok.vocab_size), block_size=pcfg.seq_len
        )
        self.model = GPT(mcfg).to(self.device)
        self.model.grad_checkpointing = tcfg.grad_checkpointing
        if tcfg.fused_ce and self.device.type == "cuda":
            self.model.fused_ce = fused_linear_cross_entropy()
            if self.model.fused_ce is None:
                log.warning(
                    "--fused-ce: liger-kernel is not installed (pip install 'lmpipe[fused]'); plain loss"
                )
        self.optimizer = make_optimizer(self.model, tcfg, self.device)
        self.scaler = make_scaler(tcfg.loss_scale, self.device) if self.precision == "fp16" else None
        self._published = (0.0, 0.0)  # scaler overflow/skip counts already added to the metrics
        # torch.compile graphs counted so far; the counter is per process (benchmarks build several trainers)
        self._graphs = self._graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if self.scaler is not None and not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            log.warning("fp16 with a non-fused optimizer: the scaler reads found_inf on the host every step")
        self.step_model = self.model
        if tcfg.compile and pcfg.strategy in ("bucket", "pad-batch") and pcfg.pad_multiple == 1:
            log.warning("--compile with --strategy %s: every row width is a new graph; "
                        "bound them with --pad-multiple (e.g. 64)", pcfg.strategy)  # fmt: skip
        if tcfg.compile:
            # one graph per row width: pack/pad have one, bucket/pad-batch as many as --pad-multiple allows
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            self.step_model = torch.compile(self.model, dynamic=False)
        self.runner = StepRunner(self.step_model, self.optimizer, tcfg, self.autocast_dtype, self.scaler)
        self.metrics = TrainerMetrics()
        for w in range(pcfg.producers):
            self.metrics.received.labels(str(w))
        self.mask_cache = MaskCache(
            on_hit=self.metrics.cache_hits.labels(MaskCache.name).inc,
            on_miss=self.metrics.cache_misses.labels(MaskCache.name).inc,
        )
        self.session = uuid.uuid4().hex[:12]
        self.table = WorkerTable(pcfg.producers)
        self.step = 0
        n_slots = tcfg.slots or 2 * tcfg.accum + 2
        pin = self.device.type == "cuda"
        dt = token_dtype(self.tok.vocab_size)
        self.slots = [HostSlot(i, pcfg.batch_size, pcfg.seq_len, dt, pin) for i in range(n_slots)]
        self.fingerprint = fingerprint(pcfg, self.tok.hash, self.tok.vocab_size)
        self.checkpoints = (
            CheckpointManager(tcfg.checkpoint_dir, tcfg.keep_checkpoints) if tcfg.checkpoint_dir else None
        )
        resume_path = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
        if resume_path is not None:
            self._restore(load(resume_path, self._identity()))
        elif tcfg.resume:
            log.info("--resume %s: no checkpoint in %s yet; starting fresh", tcfg.resume, tcfg.checkpoint_dir)
        self.copy_stream = torch.cuda.Stream() if (pin and tcfg.copy_stream) else None
        self._in_flight: list[tuple[object, HostSlot]] = []  # (copy-done event, slot)
        self._h2d_timing: list[tuple[object, object]] = []  # (start, done) timing events of each copy
        self._stop_reason = ""
        self.health_check = None  # optional callable: returns a reason to stop (e.g. a dead producer)
        self._doc_log = open(tcfg.doc_log, "a") if tcfg.doc_log else None  # noqa: SIM115 - closed in run()
        self.metrics.info.info(
            {
                "model": tcfg.model,
                "params": str(self.model.num_params()),
                "device": str(self.device),
                "precision": self.precision,
                "strategy": pcfg.strategy,
                "session": self.session,
            }
        )

    # -- checkpoints ---------------------------------------------------------------------------------

    def _identity(self) -> dict:
        """What a checkpoint must match to be resumed by this run."""
        return {
            "model": asdict(self.model.config),
            "tokenizer": self.tok.hash,
            "vocab_size": self.tok.vocab_size,
            "stream": self.pcfg.stream_fields(),
            "precision": self.precision,
        }

    def save_checkpoint(self) -> Path | None:
        if self.checkpoints is None:
            return None
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "workers": self.table.state_dict(),
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
        return path

    def _restore(self, ck) -> None:
        st = ck.state
        if (self.scaler is None) != ("scaler" not in st):  # before anything is loaded
            raise CheckpointError(
                f"{ck.path}: precision differs (loss scaler {'absent' if self.scaler is None else 'present'} here)"
            )
        self.model.load_state_dict(st["model"])
        self.optimizer.load_state_dict(st["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(st["scaler"])
            self._published = self.scaler.counters()
        self.step = int(st["step"])
        self.table.load_state_dict(st["workers"])
        torch.set_rng_state(st["rng"]["torch"])
        if "cuda" in st["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(st["rng"]["cuda"], self.device)
        if ck.header.get("data"):
            self.fingerprint["data"] = ck.header["data"]  # producers must serve the same corpus
        cursors = ", ".join(f"w{w.worker}@seq{w.last_seq}" for w in self.table.workers)
        log.info("resumed from %s: step %d, producer cursors %s", ck.path, self.step, cursors)

    def request_stop(self, reason: str = "signal") -> None:
        self._stop_reason = reason

    @property
    def interrupted(self) -> bool:
        return bool(self._stop_reason)

    # -- host -> device ------------------------------------------------------------------------------

    def _to_device(self, slot: HostSlot) -> ModelInputs:
        tokens, lengths, seg = slot.views(self.pcfg.batch_size if self.cfg.compile else None)
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            out = (tokens.to(torch.int64), lengths.clone(), None if seg is None else seg.to(torch.int32))
            self.metrics.h2d.observe(time.perf_counter() - t0)
            self.receiver.release(slot)  # converted copies: the slot is free again
        else:
            stream = self.copy_stream or torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                out = tuple(
                    None if t is None else t.to(self.device, non_blocking=True)
                    for t in (tokens, lengths, seg)
                )
                done = torch.cuda.Event(enable_timing=True)
                done.record(stream)
            self._h2d_timing.append((start, done))  # read at the logging interval, once complete
            if self.copy_stream is not None:
                compute = torch.cuda.current_stream()
                compute.wait_event(done)
                # The device tensors were allocated on the copy stream but are read on the compute stream:
                # record_stream keeps the caching allocator from handing their memory to the next copy
                # before the compute that reads them has run. Events alone cannot express that.
                for t in out:
                    if t is not None:
                        t.record_stream(compute)
            # The pinned slot is reused only after its DMA finished: polled through the event, no sync.
            self._in_flight.append((done, slot))
        tokens_d, lengths_d, seg_d = out
        return build_inputs(
            tokens_d, lengths_d, seg_d, attention=self.cfg.attention, mask_cache=self.mask_cache
        )

    def _observe_h2d(self) -> None:
        pending = []
        for start, done in self._h2d_timing:
            if done.query():
                self.metrics.h2d.observe(start.elapsed_time(done) / 1e3)
            else:
                pending.append((start, done))
        self._h2d_timing = pending

    def _release_done(self) -> None:
        keep = []
        for ev, slot in self._in_flight:
            if ev.query():
                self.receiver.release(slot)
            else:
                keep.append((ev, slot))
        self._in_flight = keep

    # -- taking batches ------------------------------------------------------------------------------

    def _take(self, n: int) -> tuple[list[HostSlot], float]:
        """Up to n slots in consumption order; fewer only when every producer has finished."""
        got: list[HostSlot] = []
        waited = 0.0
        last_news = time.monotonic()
        while len(got) < n and not self._stop_reason:
            if self.table.all_finished():
                break
            t0 = time.perf_counter()
            try:
                item = self.receiver.ready.get(timeout=0.01)
            except queue.Empty:
                waited += time.perf_counter() - t0
                self._release_done()
                self._check_receiver()
                if self.health_check and (problem := self.health_check()):
                    log.error("%s; stopping", problem)
                    self._stop_reason = problem
                    break
                now = time.monotonic()
                if now - last_news > 10:
                    log.info(
                        "waiting for batches: %d/%d producers connected",
                        self.table.connected(now),
                        len(self.table),
                    )
                    last_news = now
                    if self.cfg.wait_timeout and waited > self.cfg.wait_timeout:
                        self._stop_reason = f"no data for {waited:.0f} s"
                continue
            waited += time.perf_counter() - t0
            last_news = time.monotonic()
            self.metrics.ready_slots.set(self.receiver.ready.qsize())
            if isinstance(item, EndOfStream):
                self._consume_end(item)
            elif self._accept(item):
                got.append(item)
        return got, waited

    def _accept(self, slot: HostSlot) -> bool:
        """Consume a slot if it is the next batch of its worker; drop it otherwise."""
        m = slot.meta
        w = self.table[m.worker]
        if m.session != self.session:
            self.metrics.stale.labels("old_session").inc()
        elif m.seq <= w.last_seq:
            self.metrics.stale.labels("duplicate").inc()
        elif m.seq > w.last_seq + 1:
            self.metrics.stale.labels("gap").inc()
            log.warning(
                "worker %d sent seq %d, expected %d: asking it to resend", m.worker, m.seq, w.last_seq + 1
            )
            self.receiver.force_reset(m.worker)
        else:
            self.table.consumed(m.worker, m.seq, m.cursor)
            return True
        self.receiver.release(slot)
        return False

    def _consume_end(self, end: EndOfStream) -> None:
        w = self.table[end.worker]
        if end.session == self.session and end.seq == w.last_seq + 1:
            self.table.consumed(end.worker, end.seq, end.cursor, finished=True)
            log.info("producer %d finished its data", end.worker)

    def _check_receiver(self) -> None:
        if self.receiver.error is not None:
            raise RuntimeError(f"receive thread failed: {self.receiver.error}") from self.receiver.error

    # -- the loop ------------------------------------------------------------------------------------

    def _log_docs(self, slots: list[HostSlot]) -> None:
        rows = []
        for s in slots:
            m = s.meta
            pieces = [[int(a), int(b), int(c)] for a, b, c in zip(m.doc_id, m.doc_start, m.doc_len)]
            rows.append({"worker": m.worker, "seq": m.seq, "session": m.session, "docs": pieces})
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
        self._check_receiver()
        port = serve(self.metrics.registry, self.cfg.metrics_port)
        log.info(
            "session %s: %s on %s (%s), %.2fM params; listening on %s; expecting %d producer(s)%s",
            self.session,
            self.cfg.model,
            self.device,
            self.precision,
            self.model.num_params() / 1e6,
            self.pcfg.data_addr,
            self.pcfg.producers,
            f"; metrics on :{port}" if port else "",
        )

    def run(self, progress=None) -> Summary:
        """Train until `steps`, the end of the data, or request_stop(). `progress(step, stats)` is called
        at every logging interval (the CLI draws its status line with it)."""
        self.start()
        try:
            return self._run(progress)
        finally:
            self.receiver.stop(reason=self._stop_reason or "training finished")
            if self._doc_log:
                self._doc_log.close()

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
        flops_per_token = self.model.flops_per_token(self.pcfg.seq_len)
        while not self._stop_reason and (cfg.steps == 0 or self.step < cfg.steps):
            slots, waited = self._take(cfg.accum)
            if not slots:
                break
            if run_start is None:  # the clock starts with the first batch, not with the producers' start-up
                run_start = interval_start = time.perf_counter()
                waited = 0.0
            t0 = time.perf_counter()
            n_targets = sum(s.meta.n_targets for s in slots)
            real = sum(s.meta.real_tokens for s in slots)
            pad = sum(s.meta.pad_tokens for s in slots)
            if self._doc_log:
                self._log_docs(slots)
            micro = [self._to_device(s) for s in slots]
            lr = lr_at(self.step, cfg)
            loss_sum, norm = self.runner.step(micro, n_targets, lr)
            self.step += 1
            loss_acc += loss_sum
            targets_acc += n_targets
            interval_tokens += real
            interval_wait += waited
            summary.tokens += real
            summary.pad_tokens += pad
            summary.data_wait_seconds += waited
            m.tokens.inc(real)
            m.padding.inc(pad)
            m.steps.inc()
            m.data_wait.observe(waited)
            m.lr.set(lr)
            self._release_done()
            m.step_seconds.observe(time.perf_counter() - t0 + waited)
            if cfg.compile:
                self._count_compiles()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                loss = (loss_acc / max(targets_acc, 1)).item()  # the one host sync of the interval
                now = time.perf_counter()
                dt = now - interval_start
                stats = {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": float(norm),
                    "tokens_per_second": interval_tokens / dt if dt > 0 else 0.0,
                    "data_wait": interval_wait / dt if dt > 0 else 0.0,
                    "step_seconds": dt / max(self.step - interval_step, 1),
                    "step": self.step,
                    "padding_efficiency": summary.padding_efficiency,
                    "mfu": 0.0,
                    "loss_scale": self.scaler.get_scale() if self.scaler else 1.0,
                }
                self._publish(stats, flops_per_token)
                summary.losses.append(loss)
                if progress:
                    progress(self.step, stats)
                else:
                    log.info(
                        "step %d | loss %.4f | lr %.2e | %.0f tok/s | data wait %.1f%%",
                        self.step,
                        loss,
                        lr,
                        stats["tokens_per_second"],
                        100 * stats["data_wait"],
                    )
                loss_acc.zero_()
                targets_acc = interval_tokens = 0
                interval_wait = 0.0
                interval_start, interval_step = now, self.step
        if targets_acc:  # the tail interval
            summary.losses.append((loss_acc / targets_acc).item())
        if self.checkpoints is not None and self.step and self.checkpoints.latest_step() != self.step:
            self.save_checkpoint()  # at the end, and after SIGTERM/SIGINT once the current step is done
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        summary.steps = self.step
        summary.seconds = end - run_start if run_start else 0.0
        summary.first_loss = summary.losses[0] if summary.losses else float("nan")
        summary.last_loss = summary.losses[-1] if summary.losses else float("nan")
        summary.rejected = int(sum(s.value for s in _samples(m.rejected)))
        summary.stale = int(sum(s.value for s in _samples(m.stale)))
        summary.compiled_graphs = self._graphs - self._graphs_at_start
        if self._stop_reason:
            summary.stopped_by = self._stop_reason
        elif cfg.steps and self.step >= cfg.steps:
            summary.stopped_by = "step limit"
        else:
            summary.stopped_by = "end of data"
        return summary

    def _count_compiles(self) -> None:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if graphs > self._graphs:
            self.metrics.recompiles.inc(graphs - self._graphs)
            if self._graphs > self._graphs_at_start:
                log.info("torch.compile: %d graph(s) compiled so far", graphs - self._graphs_at_start)
            self._graphs = graphs

    def _publish(self, stats: dict, flops_per_token: float) -> None:
        m = self.metrics
        self._observe_h2d()
        m.loss.set(stats["loss"])
        m.grad_norm.set(stats["grad_norm"])
        m.loss_scale.set(stats["loss_scale"])
        if self.scaler is not None:
            overflows, skipped = self.scaler.counters()
            m.overflows.inc(overflows - self._published[0])
            m.skipped.inc(skipped - self._published[1])
            self._published = (overflows, skipped)
            stats["overflows"], stats["skipped"] = overflows, skipped
        m.mfu.set(0.0)  # stays 0 where the card's peak is unknown (and on CPU)
        if self.device.type == "cuda":
            m.gpu_memory.labels("allocated").set(torch.cuda.memory_allocated(self.device))
            m.gpu_memory.labels("reserved").set(torch.cuda.memory_reserved(self.device))
            m.gpu_memory.labels("peak").set(torch.cuda.max_memory_allocated(self.device))
            peak = _peak_flops(self.device)
            if peak:
                stats["mfu"] = stats["tokens_per_second"] * flops_per_token / peak
                m.mfu.set(stats["mfu"])


def _samples(counter):
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                yield s


def _peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of the card, for MFU. H100/H200 SXM: 989 TFLOP/s."""
    name = torch.cuda.get_device_name(device)
    for key, flops in (
        ("H100", 989e12),
        ("H200", 989e12),
        ("A100", 312e12),
        ("L4", 121e12),
        ("4090", 165e12),
    ):
        if key in name:
            return flops
    return 0.0


def print_status(step: int, stats: dict, total: int, stream=sys.stderr) -> None:
    """The compact live status: on a terminal one line rewritten in place (log lines from other
    processes push it down), otherwise one line per logging interval, for log files."""
    of = f"/{total}" if total else ""
    line = (
        f"step {step}{of} | loss {stats['loss']:.4f} | lr {stats['lr']:.2e} | "
        f"{stats['tokens_per_second']:,.0f} tok/s | data wait {100 * stats['data_wait']:.1f}% | "
        f"pad eff {100 * stats['padding_efficiency']:.1f}%"
        + (f" | scale {stats['loss_scale']:.0f}" if stats.get("loss_scale", 1.0) != 1.0 else "")
        + (f" | MFU {100 * stats['mfu']:.1f}%" if stats.get("mfu") else "")
    )
    live = stream.isatty() and step != total
    stream.write(f"\r\x1b[K{line}" if live else f"\r\x1b[K{line}\n" if stream.isatty() else f"{line}\n")
    stream.flush()
