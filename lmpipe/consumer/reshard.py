"""Resume on another number of trainer ranks: the run's global shards and each rank's share of them.

A run's first start fixes its shard space: G = world size x --shards global shards (of each source, in a
mixture), recorded in every checkpoint as "shard_space". Global shard g reads the records whose id % G == g
(producer/stream.py). Rank r of R trains the contiguous range `split(G, R, r)`: with the first start's R that
is r*S .. r*S+S-1, the layout of a run that never changed its world size. A checkpoint holds every rank's
cursors in its rank's order; a resume on another R reads them as one global list and hands each rank its
range, cursors included, so every document is still trained once. The producers learn the global shards
from the welcome (messages.Welcome.first, .space).

A mixture's mixer state (consumer/mixer.py) is split honestly: each global shard keeps the rows already
taken of its next batch; each new rank gets an equal part of every source's trained tokens and of its
deficit against its target, so the job's realized shares over the whole run stay exact within a row per
rank and source. Model, optimizer, scaler and schedule resume as before (DDP replicates them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from lmpipe.consumer.checkpoint import CheckpointError
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.ledger import cursor_list

log = logging.getLogger("lmpipe.trainer")


def split(space: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank` of `world`'s global shards [lo, hi) of `space`: contiguous, sizes differ by one at most."""
    if not 0 <= rank < world or space < world:
        raise ValueError(f"rank {rank} of {world} cannot take a share of {space} shards")
    return rank * space // world, (rank + 1) * space // world


@dataclass(frozen=True)
class Layout:
    """This rank's share of the run's global shards, and the checkpoint it resumes (if any)."""

    space: int  # G: global shards (of each source)
    first: int  # this rank's first global shard
    count: int  # this rank's shards (of each source)
    rank: int = 0
    world: int = 1
    from_world: int = 0  # the resumed checkpoint's ranks; 0: a fresh start
    from_step: int = 0
    from_accum: int = 0  # the checkpoint's --accum (0: not recorded)

    @property
    def resized(self) -> bool:
        return bool(self.from_world) and self.from_world != self.world

    def wire(self) -> tuple[int, int]:
        """(first, space), as welcomes name them."""
        return self.first, self.space


def plan(header: dict[str, Any] | None, rank: int, world: int, shards: int, where: object = "") -> Layout:
    """The layout of rank `rank` of `world` for a fresh start (`header` None: G = world x --shards) or a
    resume of the checkpoint whose header is `header`."""
    if header is None:
        return Layout(world * shards, rank * shards, shards, rank, world)
    stream = header["stream"] if isinstance(header.get("stream"), dict) else {}
    was = _int(stream.get("world_size"), 1)
    space = _int(header.get("shard_space"), was * _int(header.get("shards"), shards))
    if world > space:
        raise CheckpointError(
            f"{where} holds {space} shards and {world} ranks need one each at least: resume on {space} ranks "
            "or fewer, or start a new run with more --shards"
        )
    lo, hi = split(space, world, rank)
    step, accum = _int(header.get("step"), 0), _int(header.get("accum"), 0)
    return Layout(space, lo, hi - lo, rank, world, was, step, accum)


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def header_fields(layout: Layout, accum: int) -> dict[str, Any]:
    """What a checkpoint records of the topology (read back by plan())."""
    return {"shard_space": layout.space, "accum": accum}


def global_batch(layout: Layout, tcfg: TrainConfig, where: object = "") -> TrainConfig:
    """--keep-global-batch: --accum scaled by the checkpoint's ranks over this run's, so that a step takes
    as many batches as the checkpoint's did (a CheckpointError where they do not divide)."""
    if not (tcfg.keep_global_batch and layout.resized):
        return tcfg
    was = layout.from_accum or tcfg.accum
    batches = was * layout.from_world
    if batches % layout.world:
        raise CheckpointError(
            f"--keep-global-batch: {where}'s step took {layout.from_world} ranks x --accum {was} = {batches} "
            f"batches, which {layout.world} ranks cannot share evenly; resume on a divisor of {batches} ranks, or "
            "without --keep-global-batch (give --accum: the global batch then changes)"
        )
    try:
        return replace(tcfg, accum=batches // layout.world)
    except ValueError as exc:  # e.g. --slots below the new --accum
        raise CheckpointError(f"--keep-global-batch makes --accum {batches // layout.world}: {exc}") from None


def say_resize(layout: Layout, accum: int, batch_size: int) -> str:
    """One line: what the resume on another world size did to the shards and the global batch."""
    was_accum = layout.from_accum or accum
    old, new = layout.from_world * was_accum * batch_size, layout.world * accum * batch_size
    batch = (
        f"the global batch stays {new} rows ({_ranks(layout.world)} x --accum {accum} x {batch_size})"
        if old == new
        else f"the global batch goes from {old} rows ({layout.from_world} x --accum {was_accum} x {batch_size}) to "
        f"{new} ({layout.world} x --accum {accum} x {batch_size}); --keep-global-batch keeps it"
    )
    return (
        f"resuming a checkpoint of {_ranks(layout.from_world)} on {layout.world}: the {layout.space} shards are "
        f"re-divided ({_ranges(layout)}); {batch}"
    )


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _ranges(layout: Layout) -> str:
    spans = [split(layout.space, layout.world, r) for r in range(layout.world)]
    return ", ".join(
        f"rank {r}: {lo}" + (f"-{hi - 1}" if hi - lo > 1 else "") for r, (lo, hi) in enumerate(spans)
    )


def rank_state(by_rank: list[Any], layout: Layout, sources: int) -> Any:
    """This rank's pipeline state (Pipeline.load_state_dict) from every checkpoint rank's: its own where
    the world size is the checkpoint's, else its range of the global cursors. `sources`: a mixture's
    number of sources (1 without one)."""
    if len(by_rank) == layout.world:
        return by_rank[layout.rank]
    glob = _global(by_rank, layout.space, sources, lambda s: cursor_list(s))
    shards = [glob[i][layout.first + j] for i in range(sources) for j in range(layout.count)]
    if not isinstance(by_rank[0], dict):
        return shards
    mixes = [s["mix"] for s in by_rank]
    rows = _global(mixes, layout.space, sources, lambda m: list(m["rows_taken"]))
    mix = {
        "names": mixes[0]["names"],
        "step": mixes[0]["step"],
        "sources": [_source_share([m["sources"][i] for m in mixes], layout) for i in range(sources)],
        "rows_taken": [rows[i][layout.first + j] for i in range(sources) for j in range(layout.count)],
        "weights": mixes[0].get("weights", []),
    }
    return {"shards": shards, "mix": mix}


def _global(by_rank: list[Any], space: int, sources: int, entries: Any) -> list[list[Any]]:
    """Per source, the G global shards' entries, from each checkpoint rank's local lists."""
    out: list[list[Any]] = [[None] * space for _ in range(sources)]
    for q, state in enumerate(by_rank):
        lo, hi = split(space, len(by_rank), q)
        mine = entries(state)
        if len(mine) != sources * (hi - lo):
            raise CheckpointError(
                f"the checkpoint's rank {q} holds {len(mine)} shard entries where its share of {space} shards "
                f"({sources} source{'s' if sources > 1 else ''}) is {sources * (hi - lo)}"
            )
        for k, e in enumerate(mine):
            out[k // (hi - lo)][lo + k % (hi - lo)] = e
    return out


def _source_share(per_rank: list[dict[str, Any]], layout: Layout) -> dict[str, Any]:
    """One source's mixer state on this rank: an equal part of the job's trained tokens (the remainder to
    the lowest ranks, so the parts add up) and of its deficit against its target."""
    trained = sum(int(s["trained"]) for s in per_rank)
    deficit = sum(float(s["target"]) - int(s["trained"]) for s in per_rank)
    mine = trained // layout.world + (1 if layout.rank < trained % layout.world else 0)
    epoch = min(int(s["epoch"]) for s in per_rank)
    return {"target": mine + deficit / layout.world, "trained": mine, "rr": 0, "epoch": epoch}


def said(layout: Layout, accum: int, batch_size: int, metrics: Any, main: bool, restarts: int = 0) -> None:
    """The topology in /metrics; on rank 0, where a resume changed the world size, one line saying so."""
    metrics.world_size.set(layout.world)
    metrics.restarts.set(restarts)
    metrics.rank_shards.set(layout.count)
    if layout.from_world:
        metrics.resumed_step.set(layout.from_step)
        metrics.resumed_world_size.set(layout.from_world)
    if layout.resized and main:
        log.info("%s", say_resize(layout, accum, batch_size))


def summary(layout: Layout, restarts: int = 0) -> dict[str, int]:
    """The run summary's topology (--summary-json "topology"): rank 0's share, and torchrun's restarts of
    rank 0's workers where there were any."""
    out = {"world_size": layout.world, "shards": layout.count, "shard_space": layout.space}
    if layout.from_world:
        out.update(resumed_step=layout.from_step, resumed_world_size=layout.from_world)
    if restarts:
        out["restarts"] = restarts
    return out
