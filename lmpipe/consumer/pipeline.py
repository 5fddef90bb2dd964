"""The receive side as one object: from the sockets to model inputs on the device.

A Pipeline owns what lies between the producers and a training step: the exactly-once ledger
(consumer/ledger.py), the ring of pinned host slots, the receive thread (consumer/receiver.py), the device
feed (consumer/feed.py: take, copy on a copy stream, release), the causal-mask cache, the trainer's
Prometheus metrics and their /metrics server, the corpus pins (fingerprint, data_content, data_versions),
the doc log, and a health check of local producers. lmpipe's trainer (consumer/trainer.py) and the library's
Loader (lmpipe/loader.py) both consume it: one path.

    pipe = Pipeline(pcfg, tok, device, shards=16, slots=4)
    pipe.load_state_dict(cursors)      # optional, before start(): resume this rank's shards
    pipe.start()
    slots, waited, problem = pipe.take(1, stopping=lambda: False)
    inputs = pipe.to_device(slots[0])  # ModelInputs (consumer/inputs.py); or pipe.batch(slot): a dict
    pipe.stop("done")
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from lmpipe.consumer.batchdict import batch_dict, cu_seqlens_exact
from lmpipe.consumer.feed import DeviceFeed
from lmpipe.consumer.inputs import MaskCache, ModelInputs
from lmpipe.consumer.ledger import Ledger, cursor_list
from lmpipe.consumer.mixer import Mixer
from lmpipe.consumer.mixfeed import CREDIT_WINDOW, Assembly, MixFeed
from lmpipe.consumer.receiver import Receiver
from lmpipe.consumer.report import DocLog
from lmpipe.consumer.slots import HostSlot, SlotMeta
from lmpipe.shared.batch import token_dtype
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.metrics import TrainerMetrics, serve
from lmpipe.shared.tokenizer import TokenizerInfo

log = logging.getLogger("lmpipe.trainer")


class Pipeline:
    def __init__(
        self, pcfg: PipelineConfig, tok: TokenizerInfo, device: torch.device, *, shards: int, slots: int,
        copy_stream: bool = True, attention: str = "auto", wait_timeout: float = 0.0,
        metrics_port: int | None = -1, doc_log: str | None = None, data: str = "", data_content: str = "",
        data_versions: str = "", layout: tuple[int, int] | None = None,
    ):  # fmt: skip
        """`pcfg`: this rank's pipeline settings (consumer/config.per_rank applied). `data`, `data_content` and
        `data_versions`: the corpus producers must serve ("": the first producer pins it; Trainer's docstring).
        `metrics_port`: the /metrics port started by start() (0: any free port; -1 or None: none). `layout`:
        (first, space), each source's `shards` here are its global shards first.. of `space` (a resumed run on
        another number of ranks: consumer/reshard.py); None: the producers' --rank of --world-size."""
        self.pcfg, self.tok, self.device = pcfg, tok, device
        self.shards, self.copy_stream, self.attention = shards, copy_stream, attention
        self.wait_timeout, self.metrics_port = wait_timeout, metrics_port
        self.metrics = TrainerMetrics()
        self.metrics.producers_expected.set(pcfg.producers)
        self.mask_cache = MaskCache(
            on_hit=self.metrics.cache_hits.labels(MaskCache.name).inc,
            on_miss=self.metrics.cache_misses.labels(MaskCache.name).inc,
        )
        self.session = uuid.uuid4().hex[:12]
        # a mixture (consumer/mixer.py): each source has `shards` shards, and the mixer picks the rows
        self.mix = pcfg.mixture()
        self.mixer = Mixer(self.mix, shards, pcfg.batch_size, pcfg.seq_len) if self.mix else None
        self.table = Ledger(
            shards * (len(self.mix.sources) if self.mix else 1), self.session, *(layout or ())
        )
        for w in range(len(self.table)):
            self.metrics.received.labels(str(w))
        pin = device.type == "cuda"
        dt = token_dtype(tok.vocab_size)
        # with a mixture `slots` assemble batches; received ones get their own pool (consumer/mixfeed.py)
        received = len(self.table) * CREDIT_WINDOW if self.mix else slots
        self.slots = [HostSlot(pcfg.batch_size, pcfg.seq_len, dt, pin) for _ in range(received)]
        self.assembly_slots = (
            [HostSlot(pcfg.batch_size, pcfg.seq_len, dt, pin) for _ in range(slots)] if self.mix else []
        )
        self.fingerprint = fingerprint(pcfg, tok.hash, tok.vocab_size, data)
        self.data_content = data_content if data else ""  # the files' contents producers must serve; "": any
        self.data_versions = [data_versions] if (data and data_versions) else []  # remote objects' versions
        self.health_check: Callable[[], str | None] | None = None  # a reason to stop (e.g. a dead producer)
        self.doc_log = DocLog(doc_log) if doc_log else None  # closed by stop()
        self.receiver: Receiver | None = None
        self.feed: DeviceFeed
        self.mixfeed: MixFeed | None = None
        self.metrics_bound: int | None = None  # the /metrics port start() bound, if any

    # -- cursors ---------------------------------------------------------------------------------------

    def state_dict(self) -> Any:
        """This rank's cursors: per shard, the cursor and sequence number of the last batch taken; with a
        mixture {"shards": those, "mix": the mixer's state} (consumer/ledger.py's cursor_list reads both)."""
        if self.mixer is None:
            return self.table.state_dict()
        return {"shards": self.table.state_dict(), "mix": self.mixer.state_dict()}

    def load_state_dict(self, state: list[dict[str, Any]] | dict[str, Any]) -> None:
        """Before start(): producers are sent back to these cursors in their handshake."""
        if self.receiver is not None:
            raise RuntimeError("load_state_dict() after the pipeline started: call it before iterating")
        if (self.mixer is None) != isinstance(state, list):
            raise ValueError(
                "the state was saved " + ("without" if isinstance(state, list) else "with")
                + " a mixture and this run has " + ("one" if self.mixer else "none")
            )  # fmt: skip
        self.table.load_state_dict(cursor_list(state))
        if self.mixer is not None and isinstance(state, dict):
            self.mixer.load_state_dict(state["mix"])

    def finished(self) -> bool:
        """No more batches will come: every shard finished its epochs, or a mixture's source ran out."""
        return self.table.all_finished() or bool(self.mixer is not None and self.mixer.exhausted)

    def mixture(self) -> dict[str, dict[str, float]]:
        """Per source: tokens trained, realized share, target share, epoch ({} without a mixture)."""
        return self.mixer.shares() if self.mixer is not None else {}

    def pinned_data_content(self) -> str:
        """The corpus contents as pinned so far (the receiver pins them from the first producer)."""
        return self.receiver.data_content if self.receiver is not None else self.data_content

    def pinned_data_versions(self) -> list[str]:
        if self.receiver is not None:
            return sorted(self.receiver.data_versions.values())
        return list(self.data_versions)

    # -- running -------------------------------------------------------------------------------------

    def start(self, rows: int | None = None) -> None:
        """Bind, start the receive thread, and serve /metrics. `rows`: every batch handed out has exactly
        this many rows (a short last batch padded; compiled graphs), None: as sent."""
        self.receiver = Receiver(
            self.pcfg, self.fingerprint, self.slots, self.table, self.metrics, self.tok.vocab_size,
            data_content=self.data_content, data_versions=self.data_versions,
        )  # fmt: skip
        if self.mixer is not None:
            self.receiver.coordinator.credit_window = CREDIT_WINDOW
        self.receiver.start()
        self.receiver.bound.wait()
        assembly = Assembly(self.receiver, self.assembly_slots) if self.mixer is not None else None
        self.feed = DeviceFeed(
            cast(Receiver, assembly or self.receiver), self.table, self.metrics, self.device,
            copy_stream=self.copy_stream, rows=rows, attention=self.attention, mask_cache=self.mask_cache,
            wait_timeout=self.wait_timeout,
        )  # fmt: skip
        self.feed.health_check = self.health_check
        if self.mixer is not None and assembly is not None:
            self.mixfeed = MixFeed(self.feed, assembly, self.mixer, self.table, self.metrics)
            assert self.mix is not None
            log.info("mixing %d sources by tokens: %s", len(self.mix.sources), self.mix.describe())
        self.feed.check_receiver()
        self.metrics_bound = serve(self.metrics.registry, self.metrics_port, self.pcfg.metrics_host)

    def describe(self) -> str:
        """Where producers connect (after start())."""
        assert self.receiver is not None
        return self.receiver.endpoints.describe()

    def take(self, n: int, stopping: Callable[[], bool]) -> tuple[list[HostSlot], float, str | None]:
        """Up to n slots, each the next batch of its shard (DeviceFeed.take); with a mixture, n assembled
        batches of one optimizer step (consumer/mixfeed.py)."""
        if self.mixfeed is not None:
            return self.mixfeed.take(n, stopping)
        return self.feed.take(n, stopping)

    def to_device(self, slot: HostSlot) -> ModelInputs:
        return self.feed.to_device(slot)

    def copy(self, slot: HostSlot) -> None:
        """Copy a slot to the device and drop the result (--consume-only's step)."""
        self.feed.copy(slot)

    def batch(self, slot: HostSlot) -> dict[str, Any]:
        """The slot on the device as the library's batch dict (consumer/batchdict.py)."""
        rows = self.feed.rows
        seg_host = slot.views(rows)[2]
        cu = None if seg_host is None else cu_seqlens_exact(seg_host.numpy())
        if cu is None:  # one document per row
            B, L = slot.views(rows)[0].shape
            cu = np.arange(0, B * L + 1, L, dtype=np.int32)
        max_seqlen = int(np.diff(cu).max()) if len(cu) > 1 else 0
        cu_dev = torch.from_numpy(cu).to(self.device, non_blocking=True)
        tokens, lengths, seg, loss_mask = self.feed.copy(slot)  # on CPU the slot is released here
        return batch_dict(tokens, lengths, seg, loss_mask, cu_dev, max_seqlen)

    def release(self, slot: HostSlot) -> None:
        """Hand back a taken slot that is not copied."""
        assert self.receiver is not None
        self.feed.receiver.release(slot)

    def release_done(self) -> None:
        self.feed.release_done()

    def log_docs(self, step: int, metas: list[SlotMeta]) -> None:
        if self.doc_log:
            self.doc_log.write(step, metas)

    def check(self) -> None:
        """Raise the receive thread's error, if it failed."""
        self.feed.check_receiver()

    def stop(self, reason: str, timeout: float | None = None) -> None:
        """Tell the producers why and stop the receive thread (waited for up to `timeout` s, None: the
        receiver's default, 0: not waited for); close the doc log. Idempotent."""
        if self.receiver is not None:
            self.receiver.stop(reason=reason, timeout=timeout)
        if self.doc_log:
            doc_log, self.doc_log = self.doc_log, None
            doc_log.close()
