"""lmpipe as a library: `Loader`, an iterable of fixed-shape batches for a user's own training loop.

    from lmpipe import Loader

    with Loader(data=["corpus/"], seq_len=1024, batch_size=8, producers=2, device="cuda") as loader:
        for batch in loader:            # dict[str, torch.Tensor] on the device (consumer/batchdict.py)
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         labels=batch["labels"], use_cache=False).loss
            ...
            torch.save({"model": ..., "loader": loader.state_dict()}, "ckpt.pt")

The same settings (shared/config.py's PipelineConfig, and the trainer's data-path settings), the same checks
(lmpipe/checks.py), sockets, authentication, metrics and logs as `lmpipe run` (local_producers=True: it
starts the producers, forked by one new interpreter, lmpipe/zygote.py) and `lmpipe train`
(local_producers=False: remote producers connect). Under torchrun each rank reads its own share (RANK,
WORLD_SIZE). docs/library.md is the reference.

torch is imported only when a Loader is constructed (lmpipe/__init__.py exports Loader lazily).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from lmpipe.checks import (
    check_device,
    check_keys,
    check_not_read_back,
    check_tokenizer,
    check_writable,
    say_left_out,
)
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.ledger import Ledger
from lmpipe.launch import CorpusFacts, check_inputs, rank_settings
from lmpipe.shared.config import PipelineConfig
from lmpipe.zygote import GRACE, Zygote

if TYPE_CHECKING:
    from lmpipe.consumer.pipeline import Pipeline  # imports torch: only when a loader is constructed

log = logging.getLogger("lmpipe.loader")
STATE_FORMAT = "lmpipe.Loader/1"
WHAT = {"tokenizer": "tokenizer", "vocab_size": "vocabulary", "stream": "stream settings (seq_len, batch_size, "
        "strategy, seed, epochs...)", "shards": "number of shards", "data": "corpus"}  # fmt: skip
# the trainer's settings a Loader takes (the data path's; the rest are the model's)
TRAIN_SETTINGS = ("device", "shards", "slots", "copy_stream", "attention", "wait_timeout", "metrics_port",
                  "doc_log")  # fmt: skip


def _configs(config: PipelineConfig | None, settings: dict[str, Any]) -> tuple[PipelineConfig, TrainConfig]:
    """The settings dataclasses from a PipelineConfig and/or keyword arguments, validated as the CLI does."""
    pipe_names = {f.name for f in fields(PipelineConfig)}
    unknown = sorted(set(settings) - pipe_names - set(TRAIN_SETTINGS))
    if unknown:
        raise TypeError(f"Loader() got unknown settings {', '.join(unknown)} (PipelineConfig's fields and "
                        f"{', '.join(TRAIN_SETTINGS)} are known)")  # fmt: skip
    pkw = {k: v for k, v in settings.items() if k in pipe_names}
    if "data" in pkw:  # one path or several, as str or pathlib.Path
        data = pkw["data"]
        paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        pkw["data"] = [os.fspath(d) if isinstance(d, os.PathLike) else d for d in paths]
    cfg = replace(config, **pkw) if config is not None else PipelineConfig(**pkw)
    tkw = {k: v for k, v in settings.items() if k in TRAIN_SETTINGS}
    tkw.setdefault("metrics_port", -1)  # a library opens no port unless asked
    return cfg, TrainConfig(**tkw)


class Loader:
    """Batches from lmpipe's producers, on a device, resumable exactly once. See docs/library.md.

    Batch keys (consumer/batchdict.py): input_ids [B,L] int64; labels [B,L] int64, NOT shifted (Hugging
    Face's convention: the model shifts), -100 at pads, at each document's first token and where the loss
    mask is 0; position_ids [B,L] restarting at 0 at each document; document_ids [B,L] int32; cu_seqlens
    (int32 offsets of the document pieces in the flattened batch) and max_seqlen (int)."""

    def __init__(
        self, config: PipelineConfig | None = None, *, local_producers: bool = True, log_level: str = "INFO",
        **settings: Any,
    ):  # fmt: skip
        cfg, tcfg = _configs(config, settings)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.rank_cfg, self.tcfg = rank_settings(cfg, tcfg, local_producers)
        self.cfg, self.local_producers, self.log_level = cfg, local_producers, log_level
        # the local producers' zygote (lmpipe/zygote.py), until reaped: started first, it imports and loads the
        # tokenizer while the checks below run and the user's script goes on (builds its model); start() has
        # it fork the producers
        self._zygote: Zygote | None = None
        self._pipe: Pipeline | None = None  # from start() to close()
        if local_producers:
            self._zygote = Zygote(self.rank_cfg, self.tcfg.metrics_port, log_level)
        try:
            self._check(cfg, tcfg, local_producers)
            # the receive side's modules (torch's among them) now, not on the way to the first batch
            import lmpipe.loader_run  # noqa: F401
        except BaseException:
            self._reap()
            raise
        self._cursors: Any = None  # load_state_dict's until start(); the last ones after close()
        self.resumed_data = ""  # the corpus of the state resumed from, if it names one
        self._batches = 0  # batches yielded (this run and those before the state it resumed)
        self._closed = False

    def _check(self, cfg: PipelineConfig, tcfg: TrainConfig, local_producers: bool) -> None:
        """The CLI's checks of the settings, the corpus and the tokenizer; what a state must match."""
        check_keys(cfg, server=True)
        self.facts: CorpusFacts = check_inputs(cfg, tcfg, local_producers)
        check_device(tcfg.device)
        check_writable("doc_log", self.tcfg.doc_log)
        check_not_read_back("doc_log", self.tcfg.doc_log, cfg.data)
        tok = check_tokenizer(cfg)
        self.identity = {
            "tokenizer": tok.hash,
            "vocab_size": tok.vocab_size,
            "stream": replace(self.rank_cfg, rank=0).stream_fields(),
            "shards": tcfg.shards,
            "data": self.facts.data,
        }
        self.vocab_size: int = tok.vocab_size  # the tokenizer's: a model's embedding needs at least this many

    # -- state (torchdata's Stateful protocol) --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A plain picklable dict: this rank's cursors after the last batch yielded (it covers that batch:
        a resume from it yields the next one, never that one again), and what it must be resumed with."""
        cursors = self._pipe.state_dict() if self._pipe is not None else self._cursors
        return {"format": STATE_FORMAT, "rank": self.rank, "world_size": self.world, "batches": self._batches,
                "identity": dict(self.identity), "cursors": cursors}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state_dict(); before iteration starts. A state of another corpus, tokenizer, stream
        settings, rank or world size is refused in one line (ValueError)."""
        if self._pipe is not None:
            raise RuntimeError("Loader.load_state_dict() after iteration started: call it before")
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = (
                f"format {state.get('format')}" if isinstance(state, dict) and "format" in state else "none"
            )
            raise ValueError(f"not a Loader state of this version: {found}; this lmpipe reads {STATE_FORMAT}")
        try:  # every field checked before any is kept: a refused state changes nothing
            rank, world, batches = int(state["rank"]), int(state["world_size"]), int(state["batches"])
            got, cursors = dict(state["identity"]), state["cursors"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a damaged Loader state ({type(exc).__name__}: {exc})") from None
        if (rank, world) != (self.rank, self.world):
            raise ValueError(f"the state is rank {rank} of {world}, this loader rank {self.rank} of "
                             f"{self.world}: resume each rank from its own state, with as many")  # fmt: skip
        skip = () if (got.get("data") and self.identity["data"]) else ("data",)  # unknown: the producers'
        if diff := [
            k
            for k in sorted(set(got) | set(self.identity))
            if k not in skip and got.get(k) != self.identity.get(k)
        ]:
            raise ValueError(f"the state is of another {' and '.join(WHAT.get(k, k) for k in diff)} than this loader's: "
                             "resume with the settings, tokenizer and corpus it was saved with")  # fmt: skip
        if cursors is not None:
            try:  # read as the pipeline will, so that damaged cursors fail here and not when iteration starts
                mixture = self.rank_cfg.mixture()  # a mixture's ledger: --shards per source
                Ledger(self.tcfg.shards * (len(mixture.sources) if mixture else 1), "").load_state_dict(
                    cursors
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(
                    f"a damaged Loader state: its cursors ({type(exc).__name__}: {exc})"
                ) from None
        self._cursors, self._batches, self.resumed_data = cursors, batches, str(got.get("data") or "")

    def __len__(self) -> int:
        raise TypeError("len(Loader) is unknown: producers pack documents into rows as they read them, so the "
                        "number of batches of an epoch is known only at its end (as for an IterableDataset)")  # fmt: skip

    # -- processes ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the local producers and the receive side (iterating starts them too)."""
        if self._pipe is not None:
            return
        if self._closed:
            raise RuntimeError("the Loader is closed")
        from lmpipe.loader_run import build_pipeline

        try:
            if self.local_producers:
                say_left_out(self.cfg.data)
                assert self._zygote is not None
                self._zygote.fork()  # the producers start while this process binds its sockets
            self._pipe = build_pipeline(self)
            pids = self._zygote.wait_started() if self._zygote is not None else []
        except BaseException:
            self.close()
            raise
        log.info("loader rank %d of %d: listening on %s; %d shards%s%s", self.rank, self.world,
                 self._pipe.describe(), self.tcfg.shards,
                 f"; producer pids {' '.join(map(str, pids))}" if pids else "",
                 f"; metrics on :{self._pipe.metrics_bound}" if self._pipe.metrics_bound else "")  # fmt: skip

    def _epochs_done(self) -> None:
        """Every shard finished its epochs: the producers are told to stop and reaped now, not at close().
        The loader stays usable: state_dict() covers the last batch, and a new `for` yields nothing."""
        self._stop(self._pipe, "every shard finished its epochs")

    def _stop(self, pipe: Pipeline | None, reason: str) -> None:
        """Stop the receive side and the local producers, each wait bounded: the producers are told why,
        then reaped (their `bye` and exit, else SIGTERM, then SIGKILL: Zygote.stop), then the receive thread,
        which has no `bye` left to wait for, is joined. Remote producers: the receive thread waits for their
        `bye` (Receiver.stop)."""
        local = self._zygote is not None
        try:
            if pipe is not None:
                pipe.stop(reason, timeout=0 if local else None)
        finally:
            try:  # no pipeline (a start that failed): nothing tells the producers to stop but SIGTERM
                self._reap(GRACE if pipe is not None else 0.0)
            finally:
                if pipe is not None and local:
                    pipe.stop(reason, timeout=2 * GRACE)

    def _reap(self, grace: float = GRACE) -> None:
        if self._zygote is not None:
            try:
                self._zygote.stop(grace)
            finally:
                self._zygote = None

    def producers_alive(self) -> str | None:
        """The health check: a reason to stop when a local producer exited with an error, or their zygote died."""
        return self._zygote.problem() if self._zygote is not None else None

    @property
    def producer_pids(self) -> list[int]:
        """The local producers' pids (after start())."""
        zygote = self._zygote
        return [p.pid for p in zygote.producers if p.pid is not None] if zygote is not None else []

    def close(self, reason: str = "the loader closed") -> None:
        """Tell the producers to stop, stop the receive thread and reap the local producers. Idempotent."""
        self._closed = True
        pipe, self._pipe = self._pipe, None
        try:
            if pipe is not None:
                self._cursors = pipe.state_dict()  # state_dict() after close() still covers the last batch
        finally:
            self._stop(pipe, reason)

    def __enter__(self) -> Loader:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        why = "the loader closed"
        if exc_type is KeyboardInterrupt:
            why = signal.Signals.SIGINT.name
        elif exc_type is not None:
            why = f"the training loop failed ({exc_type.__name__})"
        self.close(why)

    def __del__(self) -> None:  # a loader dropped without close(): its producers still go
        if getattr(self, "_zygote", None) is not None or getattr(self, "_pipe", None) is not None:
            with suppress(Exception):
                self.close()

    # -- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Batches until every shard has read its `epochs` (0: until the loop stops)."""
        self.start()
        from lmpipe.loader_run import batches

        return batches(self)
