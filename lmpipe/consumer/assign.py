"""Which connected producer holds which shard: the trainer's assignment policy, and its bookkeeping.

The run's corpus is split into a fixed number of shards (--shards; shard s owns records with id % S == s).
Shards, not producers, carry the exactly-once state (cursor, sequence number, lease: consumer/ledger.py),
so any producer can serve any shard from where the trainer left it. This module only decides who serves
what: on every join and every leave the open shards (not finished, not failed) are spread as evenly as
possible over the live producers, in join order, moving as few shards as it can:

- a producer keeps what it holds up to its share (ceil or floor of open/producers; the producers holding
  the most keep the larger shares);
- shards over a producer's share, and the shards of producers that left, go to those under theirs;
- producers beyond the number of open shards hold none and stand by until one leaves.

Moving a shard costs its new holder a restart from the trainer's cursor (for streamed text, reading up to
that position again without tokenizing it), so a join takes what it needs from the most loaded producers
and nothing else moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Producer:
    """A producer process the trainer has welcomed (its control connection's routing id)."""

    identity: bytes
    name: str  # `producer 0`, or `producer #3` without a number of its own: producer_name()
    where: str  # host:pid, as it said in its hello
    worker: int  # its own --worker number (-1: none), for logs
    fd: int = -1  # its control connection (consumer/connections.py)
    last_seen: float = 0.0
    shards: set[int] = field(default_factory=set)
    waiting: str = ""  # what it says it waits on (messages.Hello.waiting), for the trainer's wait line

    def label(self) -> str:
        return f"{self.name} ({self.where})"


def producer_name(worker: int, joined: int, taken: set[str]) -> str:
    """The producer's name in the trainer's log lines: `producer N` for one with a number of its own N
    (`--worker N`; `lmpipe run` numbers its producers, whose lines say `[producer N]`), `producer #K` for one
    without (--worker -1: the K-th to join this session). A number another registered producer goes by
    (a restarted one, its old registration not gone yet) gets its ` #K` too: names are unique."""
    if worker < 0:
        return f"producer #{joined}"
    name = f"producer {worker}"
    return name if name not in taken else f"{name} #{joined}"


def balance(holdings: dict[bytes, set[int]], open_shards: set[int]) -> dict[bytes, set[int]]:
    """The new holdings: every open shard held by exactly one producer, each producer holding its even
    share, with as few shards moved as possible. `holdings` is in join order; shards not open (finished,
    failed) are dropped from it."""
    keys = list(holdings)
    if not keys:
        return {}
    kept = {k: sorted(holdings[k] & open_shards) for k in keys}
    seen: set[int] = set()
    for k in keys:  # a shard named twice (never, but cheap to rule out) stays with the earlier producer
        kept[k] = [s for s in kept[k] if s not in seen]
        seen.update(kept[k])
    base, extra = divmod(len(open_shards), len(keys))
    by_load = sorted(keys, key=lambda k: -len(kept[k]))  # stable: ties go to the earlier producer
    share = {k: base + (1 if i < extra else 0) for i, k in enumerate(by_load)}
    pool = sorted(open_shards - seen)
    for k in keys:
        while len(kept[k]) > share[k]:
            pool.append(kept[k].pop())  # the highest-numbered ones move
    pool.sort()
    for k in keys:
        while len(kept[k]) < share[k]:
            kept[k].append(pool.pop(0))
    return {k: set(v) for k, v in kept.items()}


def shard_list(shards: set[int] | list[int]) -> str:
    """'0,3,5' or 'none', for log lines."""
    return ",".join(map(str, sorted(shards))) or "none"


def moved_to(moved: dict[int, tuple[Producer, str]]) -> str:
    """'0,1,2 to producer 0, 3 to producer 2' for a leave line: the shards each producer took."""
    by: dict[str, set[int]] = {}
    for s, (q, _) in moved.items():
        by.setdefault(q.name, set()).add(s)
    return ", ".join(f"{shard_list(v)} to {n}" for n, v in sorted(by.items(), key=lambda kv: min(kv[1])))


def taken_from(moved: dict[int, tuple[Producer, str]], p: Producer) -> str:
    """' (from producer 0, producer 1)' for a join line: whom its shards came from (`moved`: shard -> (new holder, old
    holder's name))."""
    src = sorted({old for new, old in moved.values() if new is p and old})
    return f" (from {', '.join(src)})" if src else ""
