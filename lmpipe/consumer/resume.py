"""A trainer's resume from a checkpoint, once its header passed (consumer/checkpoint.py's compare): the
state loaded, this rank's cursors (consumer/reshard.py where the world size changed), the corpus pinned."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmpipe.consumer.checkpoint import CheckpointError, Loaded, more_epochs
from lmpipe.consumer.ledger import cursor_list
from lmpipe.consumer.reshard import rank_state
from lmpipe.consumer.step import lr_at

if TYPE_CHECKING:
    from lmpipe.consumer.trainer import Trainer

log = logging.getLogger("lmpipe.trainer")


def restore(t: Trainer, ck: Loaded) -> None:
    """Load checkpoint `ck` into trainer `t` (model, optimizer, scaler, step, RNG, this rank's cursors: its
    share of every rank's where the world size changed, consumer/reshard.py) and pin its corpus."""
    st = ck.state
    at, steps = int(st["step"]), t.cfg.steps
    if steps and at >= steps:  # else it would stop at once, having trained nothing, and exit 0
        raise CheckpointError(
            f"{ck.path} is at step {at}, at or past --steps {steps}: nothing to train; raise --steps"
        )
    # format 1 (lmpipe 0.1.0) held one rank's cursors; format 2 a list of them per rank
    by_rank = st["workers"] if ck.header["format_version"] >= 2 else [st["workers"]]
    epochs = t.pcfg.epochs
    before = int((ck.header.get("stream") or {}).get("epochs") or 0)
    more = more_epochs(before, epochs)  # compare() let it through: finished shards go on
    if epochs and not more and all(w.get("finished") for rank in by_rank for w in cursor_list(rank)):
        # every shard of every rank read its --epochs to the end: it would stop at once, having trained
        # nothing, and exit 0 (the same on every rank: by_rank is every rank's; a rank whose shards all
        # finished while others' had data left steps on nothing beside them, at any world size)
        raise CheckpointError(
            f"{ck.path} finished --epochs {epochs} (every shard reached the end of its data at step {at}): "
            "nothing to train; start a new run (another --checkpoint-dir, or no --resume), or resume from "
            "an earlier checkpoint"
        )
    if (t.scaler is None) != ("scaler" not in st):  # before anything is loaded
        raise CheckpointError(
            f"{ck.path}: precision differs (loss scaler {'absent' if t.scaler is None else 'present'} here)"
        )
    if t.model is not None:
        t.model.load_state_dict(st["model"])
        t.optimizer.load_state_dict(st["optimizer"])
        say_schedule_change(t, at)
    if t.scaler is not None:
        t.scaler.load_state_dict(st["scaler"])
        t._published = t.scaler.counters()
    t.step = int(st["step"])
    t.pipe.load_state_dict(rank_state(by_rank, t.layout, len(t.pipe.mix.sources) if t.pipe.mix else 1))
    if more:
        for w in t.table.shards:
            w.finished = False  # its producer starts it again at its cursor: the next epoch
        log.info("--epochs %s after the checkpoint's %d: shards go on into epoch %d", epochs or "0 (until stopped)",
                 before, before + 1)  # fmt: skip
    torch.set_rng_state(st["rng"]["torch"])
    if "cuda" in st["rng"] and t.device.type == "cuda":
        torch.cuda.set_rng_state(st["rng"]["cuda"], t.device)
    if ck.header.get("data"):
        if ck.header["data"] != t.fingerprint.get("data"):
            t.data_content = ""  # the given corpus's contents are not the checkpoint's corpus's
            t.data_versions = []
            t.data_objects = {}
        t.fingerprint["data"] = ck.header["data"]  # producers must serve the same corpus
        if ck.header.get("data_content"):  # and the same contents (older checkpoints lack it)
            t.data_content = str(ck.header["data_content"])
        if isinstance(ck.header.get("data_versions"), list):  # and the same remote objects' versions
            # beside --data's own (another location: lmpipe/launch.py refused a changed one already)
            t.data_versions = list(
                dict.fromkeys(t.data_versions + [str(v) for v in ck.header["data_versions"]])
            )
        if isinstance(objs := ck.header.get("data_objects"), dict):  # and each object's (kept on)
            t.data_objects = {**{str(k): str(v) for k, v in objs.items()}, **t.data_objects}
    cursors = ", ".join(f"s{w.shard}@seq{w.last_seq}" for w in t.table.shards)
    log.info("resumed from %s: step %d, shard cursors %s", ck.path, t.step, cursors)
    t.metrics.global_step.set(t.step)
    t.metrics.checkpointed(t.step, Path(ck.path).stat().st_mtime)


def say_schedule_change(t: Trainer, at: int) -> None:
    """A resume follows this run's learning-rate schedule; where it differs from the one the checkpoint
    trained with (a larger --steps stretches the cosine), the rate jumps: said, not done silently."""
    if at == 0:
        return
    last = float(t.optimizer.param_groups[0]["lr"])  # what the checkpoint's last step trained at
    here = lr_at(at - 1, t.cfg)
    if abs(here - last) > 0.01 * abs(last):
        log.warning(
            "the learning rate jumps: the checkpoint's step %d trained at %.3g, where this run's schedule "
            "(--lr, --warmup, --min-lr-ratio, and the cosine over --lr-decay-steps, else --steps) has %.3g, "
            "and its step %d trains at %.3g; to go on along the checkpoint's curve, give its run's settings "
            "(its --steps as --lr-decay-steps)", at, last, here, at + 1, lr_at(at, t.cfg),
        )  # fmt: skip
