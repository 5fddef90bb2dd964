"""The torch half of lmpipe/loader.py: the Loader's pipeline (consumer/pipeline.py) and its batches.

Imported only when a Loader starts, so that `from lmpipe import Loader` does not import torch.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lmpipe.consumer.pipeline import Pipeline
from lmpipe.consumer.step import resolve_device
from lmpipe.shared.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from lmpipe.loader import Loader

log = logging.getLogger("lmpipe.loader")
OBSERVE_EVERY = 10  # batches between reads of the copies' CUDA events (the trainer: every log interval)


def build_pipeline(loader: Loader) -> Pipeline:
    """This rank's pipeline, resumed from the loader's state if it has one, started."""
    cfg, tcfg = loader.rank_cfg, loader.tcfg
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if loader.world > 1 else None
    device = resolve_device(tcfg.device, local_rank)
    tok = load_tokenizer(cfg.tokenizer, cfg.data)
    facts = loader.facts
    pipe = Pipeline(
        cfg, tok, device, shards=tcfg.shards, slots=tcfg.slots or 4, copy_stream=tcfg.copy_stream,
        attention=tcfg.attention, wait_timeout=tcfg.wait_timeout, metrics_port=tcfg.metrics_port,
        doc_log=tcfg.doc_log, data=facts.data, data_content=facts.content, data_versions=facts.versions,
    )  # fmt: skip
    if loader._cursors is not None:
        pipe.load_state_dict(loader._cursors)
        if loader.resumed_data:
            pipe.fingerprint["data"] = loader.resumed_data  # producers must serve the same corpus
        cursors = ", ".join(f"s{w.shard}@seq{w.last_seq}" for w in pipe.table.shards)
        log.info("resumed after batch %d: shard cursors %s", loader._batches, cursors)
    # through a weak reference: the pipeline must not keep its loader alive, so that a loader dropped without
    # close() is freed at once (its __del__ stops the producers), not at some later garbage collection
    ref = weakref.ref(loader)
    pipe.health_check = lambda: None if (alive := ref()) is None else alive.producers_alive()
    try:
        pipe.start(rows=cfg.batch_size)  # fixed-shape batches: a short last batch gets empty rows
    except BaseException:  # a Ctrl-C half-way: the receive thread, if it started, ends (and frees its port)
        pipe.stop("the loader did not start", timeout=0)
        raise
    pipe.metrics.info.info(
        {
            "model": "none (library)",
            "params": "0",
            "device": str(device),
            "precision": "",
            "strategy": cfg.strategy,
        }
    )
    return pipe


def batches(loader: Loader) -> Iterator[dict[str, Any]]:
    """One batch per next(): the next batch of any shard, on the device, counted in the trainer's metrics
    (tokens, data wait, steps) and written to the doc log before it is yielded."""
    while True:
        pipe = loader._pipe
        if pipe is None or pipe.finished():  # closed, or every shard finished its epochs
            return
        # the slots whose copies to the device are done go back to the receiver first: take() frees them
        # only while it waits, and with every slot in flight the producers' batches would find no room
        pipe.release_done()
        slots, waited, problem = pipe.take(1, stopping=lambda: loader._closed)
        if problem:
            loader.close(problem)
            raise RuntimeError(f"{problem}; the loader stopped")
        if not slots:
            pipe.metrics.data_wait.observe(waited)
            if pipe.finished():
                loader._epochs_done()
            return
        t0 = time.perf_counter()
        meta = slots[0].meta
        assert meta is not None
        pipe.log_docs(loader._batches, [meta])
        batch = pipe.batch(slots[0])
        m = pipe.metrics
        m.tokens.inc(meta.real_tokens)
        m.loss_tokens.inc(meta.n_targets)
        m.padding.inc(meta.pad_tokens)
        m.data_wait.observe(waited)
        m.steps.inc()
        loader._batches += 1
        m.global_step.set(loader._batches)
        m.last_step_time.set(time.time())
        m.step_seconds.observe(time.perf_counter() - t0 + waited)
        if loader._batches % OBSERVE_EVERY == 0:
            pipe.feed.observe_h2d()  # the finished copies' times (CUDA events, queried: no sync)
        yield batch
