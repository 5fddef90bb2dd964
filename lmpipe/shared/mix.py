"""Data mixtures: named, weighted sources, and how a rank's shards are numbered across them.

A mixture is given on the command line (`--mix NAME=SOURCE:WEIGHT ...`, or `LMPIPE_MIX`) or in a TOML file
(`--mix-file`, which may also give each source's epochs, several files a source, and a schedule of weights
over optimizer steps; docs/mixtures.md). The trainer decides what is trained next by token counts (the
source furthest behind its target); producers serve each source's shards, paced by the trainer's credits.

Shards: each source has `--shards` shards per rank; a rank's shard `l` is source `l // shards`, that
source's shard `l % shards`, read exactly as a single corpus's shard is today (global shard
`rank * shards + j` of `world * shards`) from the source's own files, shuffled with the source's own seed
(from the run's seed and the source's name: adding a source reshuffles no other one).

What identifies a mixture's data (the handshake's fingerprint, the checkpoint's header) is its sources'
names, epochs and files, never the weights or the schedule: those are the trainer's alone, and may change
at a resume.
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME = re.compile(r"[a-z0-9_-]{1,32}")
MAX_SOURCES = 64  # more is a typo or a generated file gone wrong; the shard numbering has room for them
_SOURCE_KEYS = {"data", "weight", "epochs"}


@dataclass(frozen=True)
class Source:
    name: str  # [a-z0-9_-]{1,32}, unique
    data: tuple[str, ...]  # anything --data takes (files, folders, globs, URLs, a prepared shard set)
    weight: float  # > 0 (weights need not sum to 1)
    epochs: int  # 0: repeat forever, each pass reshuffled; N: N passes, then the run stops


@dataclass(frozen=True)
class Mix:
    sources: tuple[Source, ...]
    # (step, weights in source order), steps ascending; empty: the sources' weights throughout
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def weights_at(self, step: int) -> tuple[float, ...]:
        """The weights at optimizer step `step`, normalized to sum 1: piecewise-linear between the
        schedule's points, flat before the first and past the last."""
        if not self.schedule:
            raw = tuple(s.weight for s in self.sources)
        elif step <= self.schedule[0][0]:
            raw = self.schedule[0][1]
        elif step >= self.schedule[-1][0]:
            raw = self.schedule[-1][1]
        else:
            i = next(k for k in range(1, len(self.schedule)) if step < self.schedule[k][0])
            (s0, w0), (s1, w1) = self.schedule[i - 1], self.schedule[i]
            t = (step - s0) / (s1 - s0)
            raw = tuple(a + t * (b - a) for a, b in zip(w0, w1))
        total = sum(raw)
        return tuple(w / total for w in raw)

    def fingerprint(self) -> str:
        """The sources' names and epochs, in order (their files are in the fingerprint's `data`): what a
        producer and the trainer must agree on, and a checkpoint resumes with. Not the weights."""
        return ";".join(f"{s.name}:epochs={s.epochs}" for s in self.sources)

    def describe(self) -> str:
        """One line for the log: `web 70%, code 20%, math 10%` (the weights at step 0)."""
        return ", ".join(f"{s.name} {100 * w:.3g}%" for s, w in zip(self.sources, self.weights_at(0)))


def shard_source(shard: int, shards_per_source: int) -> tuple[int, int]:
    """A rank's shard id -> (source index, shard index within the source)."""
    if shards_per_source < 1 or shard < 0:
        raise ValueError(f"shard {shard} of {shards_per_source} a source: out of range")
    return shard // shards_per_source, shard % shards_per_source


def source_seed(seed: int, name: str) -> int:
    """A source's shuffle seed, from the run's seed and the source's name (not its place in the mixture)."""
    digest = hashlib.sha256(f"lmpipe-mix:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: a msgpack int, a numpy seed


def _weight(text: Any, where: str) -> float:
    if isinstance(text, bool):
        raise ValueError(f"{where}: the weight {text!r} is not a number")
    try:
        w = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: the weight {text!r} is not a number") from None
    if not math.isfinite(w) or w <= 0:
        raise ValueError(f"{where}: the weight {text!r} must be a finite number > 0")
    return w


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"{where}: the source name {name!r} must be 1-32 characters of a-z, 0-9, '_' and '-'"
        )
    return name


def _checked(sources: list[Source], where: str) -> tuple[Source, ...]:
    if not sources:
        raise ValueError(f"{where}: a mixture needs at least one source")
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"{where}: {len(sources)} sources, at most {MAX_SOURCES}")
    seen: set[str] = set()
    for s in sources:
        if s.name in seen:
            raise ValueError(f"{where}: the source name {s.name!r} is given twice")
        seen.add(s.name)
    return tuple(sources)


def parse_mix(items: list[str], *, epochs: int = 0) -> Mix:
    """`NAME=SOURCE:WEIGHT` items (split at the first '=' and the last ':', so that a SOURCE may be a URL):
    one source each, of one --data item, with the run's `epochs`. ValueError (one line) on bad input."""
    sources = []
    for item in items:
        name, eq, rest = item.partition("=")
        data, colon, weight = rest.rpartition(":")
        if not eq or not colon:
            raise ValueError(f"--mix {item!r}: write NAME=SOURCE:WEIGHT (e.g. web=data/web/:0.7)")
        _name(name, f"--mix {item!r}")
        if not data:
            raise ValueError(f"--mix {item!r}: the source {name!r} names no data (NAME=SOURCE:WEIGHT)")
        w = _weight(weight, f"--mix {item!r}")
        sources.append(Source(name, (data,), w, epochs))
    return Mix(_checked(sources, "--mix"))


def load_mix_file(path: str, *, epochs: int = 0) -> Mix:
    """A mixture from a TOML file (docs/mixtures.md): `[sources.NAME]` tables with `data` (a path or a list
    of them), `weight` and optionally `epochs` (default: the run's `epochs`), in the order written; and
    optionally `[[schedule]]` points (`step`, `weights = {NAME = W, ...}` naming every source), steps
    ascending. ValueError (one line, naming the file) on bad input."""
    where = f"--mix-file {path}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{where}: not a valid TOML file ({exc})") from None
    unknown = set(doc) - {"sources", "schedule"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; a mix file has "
                         "[sources.NAME] tables and [[schedule]] points")  # fmt: skip
    table = doc.get("sources")
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: no sources: add a [sources.NAME] table with data and weight")
    sources = [_file_source(name, spec, f"{where}: [sources.{name}]", epochs) for name, spec in table.items()]
    mix = Mix(_checked(sources, where))
    schedule = doc.get("schedule", [])
    if not isinstance(schedule, list):
        raise ValueError(f"{where}: schedule must be [[schedule]] points (step, weights)")
    return Mix(mix.sources, _schedule(schedule, mix.names(), where))


def _file_source(name: str, spec: Any, where: str, epochs: int) -> Source:
    _name(name, where)
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must be a table with data and weight")
    if unknown := set(spec) - _SOURCE_KEYS:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; it takes data, weight, epochs"
        )
    data = spec.get("data")
    data = [data] if isinstance(data, str) else data
    if not isinstance(data, list) or not data or not all(isinstance(d, str) and d for d in data):
        raise ValueError(f"{where}: data must be a path or a list of paths (anything --data takes)")
    if "weight" not in spec:
        raise ValueError(f"{where}: lacks a weight")
    e = spec.get("epochs", epochs)
    if not isinstance(e, int) or isinstance(e, bool) or e < 0:
        raise ValueError(f"{where}: epochs {e!r} must be an integer >= 0 (0: repeat forever)")
    return Source(name, tuple(data), _weight(spec["weight"], where), e)


def _schedule(
    points: list[Any], names: tuple[str, ...], where: str
) -> tuple[tuple[int, tuple[float, ...]], ...]:
    out: list[tuple[int, tuple[float, ...]]] = []
    for k, p in enumerate(points):
        at = f"{where}: [[schedule]] point {k + 1}"
        if not isinstance(p, dict) or set(p) != {"step", "weights"}:
            raise ValueError(f"{at}: must have exactly step and weights")
        step, weights = p["step"], p["weights"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"{at}: step {step!r} must be an integer >= 0")
        at = f"{where}: [[schedule]] step {step}"
        if out and step <= out[-1][0]:
            raise ValueError(f"{at} follows step {out[-1][0]}: steps must be in ascending order")
        if not isinstance(weights, dict):
            raise ValueError(f"{at}: weights must be a table {{ NAME = WEIGHT, ... }}")
        if unknown := [n for n in weights if n not in names]:
            raise ValueError(f"{at}: unknown source {unknown[0]!r} (the sources: {', '.join(names)})")
        if missing := [n for n in names if n not in weights]:
            raise ValueError(f"{at}: lacks a weight for {missing[0]!r} (every source needs one)")
        out.append((step, tuple(_weight(weights[n], f"{at}: {n}") for n in names)))
    return tuple(out)
