"""What a producer reads: one corpus (--data, or the built-in one), or one per source of a mixture.

Without a mixture this is the one corpus, its shards and facts exactly as before. With one (shared/mix.py),
each source is a corpus of its own, read with every format and option a --data corpus has; the trainer's
shard `l` of `len(sources) * shards` is source `l // shards`, read as that source's shard `l % shards`
(global `rank * shards + j` of `world * shards`), shuffled with the source's own seed and passed over
its own number of epochs. The facts the hello carries about the data (the fingerprint's `data`, the files'
contents, the remote objects' versions) cover every source: one digest over all of them, so that the
trainer's checks (consumer/admission.py) refuse a producer whose files differ in any source.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.scan import SCAN_BUDGET_BYTES, SharedScan
from lmpipe.producer.shards import check_prepared_with
from lmpipe.producer.sources import MAX_FINGERPRINT, Corpus
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.messages import Assign, Welcome, version_location
from lmpipe.shared.mix import Mix, shard_source, source_seed
from lmpipe.shared.tokenizer import TokenizerInfo


def source_config(cfg: PipelineConfig, data: tuple[str, ...]) -> PipelineConfig:
    """The settings a source's corpus is read with: the run's, with the source's data as --data."""
    return replace(cfg, data=list(data), mix=[], mix_file=None)


def open_source(cfg: PipelineConfig, name: str, data: tuple[str, ...], vocab_size: int | None) -> Corpus:
    """A source's corpus; what is wrong with it says the source's name."""
    try:
        return Corpus.of(source_config(cfg, data), vocab_size)
    except (OSError, ValueError) as exc:
        raise (OSError if isinstance(exc, OSError) else ValueError)(f"source {name!r}: {exc}") from None


class Corpora:
    def __init__(
        self,
        cfg: PipelineConfig,
        vocab_size: int | None = None,
        mix: Mix | None = None,
        *,
        corpora: list[Corpus] | None = None,  # opened already (lmpipe/checks.py), in source order
    ):
        self.cfg = cfg
        self.mix = mix if mix is not None else cfg.mixture()
        if corpora is not None:
            self.corpora = corpora
        elif self.mix is None:
            self.corpora = [Corpus.of(cfg, vocab_size)]
        else:
            self.corpora = [open_source(cfg, s.name, s.data, vocab_size) for s in self.mix.sources]
        self.spec = BatchSpec.of(cfg)
        self._scans: dict[int, SharedScan] = {}  # source -> the producer's one read of it (scan.py)

    def __len__(self) -> int:
        return len(self.corpora)

    def name(self, i: int) -> str:
        return self.mix.sources[i].name if self.mix is not None else ""

    def check_prepared(self, tok: TokenizerInfo) -> None:
        for c in self.corpora:
            if c.shards is not None:
                check_prepared_with(c.shards, tok)

    # -- shards -----------------------------------------------------------------------------------------

    def locate(self, shard: int, total: int) -> tuple[int, int, int]:
        """The trainer's shard `shard` of `total`: (source, the source's shard, the source's shards)."""
        if self.mix is None:
            return 0, shard, total
        n = len(self.mix.sources)
        if total % n:
            raise ValueError(f"{total} shards cannot be split among the mixture's {n} sources")
        per = total // n
        i, j = shard_source(shard, per)
        return i, j, per

    def split_problem(self, msg: Assign | Welcome) -> str | None:
        """What is wrong with the trainer's number of shards in an assign or welcome (a mixture's must
        split evenly among its sources), or None."""
        total = msg.total if isinstance(msg, Assign) else msg.shards
        if self.mix is None or total % len(self.mix.sources) == 0:
            return None
        return (
            f"the trainer's {total} shards do not split among the mixture's {len(self.mix.sources)} sources"
        )

    def plan(self, shard: int, total: int) -> tuple[BatchSpec, int]:
        """The shard's batch settings (its source's seed) and epochs (held.Holdings' plan)."""
        source = self.locate(shard, total)[0]
        return self.batch_spec(source), self.epochs(source)

    def finished_what(self) -> str:
        """What a producer whose shards all ended finished, for its log line."""
        if self.mix is not None:
            return "its sources' epochs"
        # --epochs 0 (until stopped) ends early only where the shards own no documents
        return f"its {self.cfg.epochs} epoch(s)" if self.cfg.epochs else "(its shards own no documents)"

    def seed(self, i: int) -> int:
        """Source i's shuffle seed: the run's, or one from it and the source's name."""
        return self.cfg.seed if self.mix is None else source_seed(self.cfg.seed, self.mix.sources[i].name)

    def epochs(self, i: int) -> int:
        return self.cfg.epochs if self.mix is None else self.mix.sources[i].epochs

    def batch_spec(self, i: int) -> BatchSpec:
        return self.spec if self.mix is None else replace(self.spec, seed=self.seed(i))

    def scan(self, i: int, shards: int) -> SharedScan:
        """Source i's shared read for `shards` global shards (a new split: nothing carries over)."""
        scan = self._scans.get(i)
        if scan is None or scan.total != shards:  # the sources share the read-ahead budget
            budget = max(SCAN_BUDGET_BYTES // len(self.corpora), 16 << 20)
            scan = self._scans[i] = SharedScan(self.corpora[i], shards, budget)
        return scan

    # -- what the hello says about the data ----------------------------------------------------------

    def describe(self) -> str:
        if self.mix is None:
            return self.corpora[0].describe()
        return "; ".join(f"{s.name}: {c.describe()}" for s, c in zip(self.mix.sources, self.corpora))

    def fingerprint(self) -> str:
        """The fingerprint's `data`: the corpus's (Corpus.fingerprint), or a mixture's as a JSON map of each
        source's name to its corpus's, each within its share of MAX_FINGERPRINT (a hello stays small)."""
        if self.mix is None:
            return self.corpora[0].fingerprint()
        limit = MAX_FINGERPRINT // len(self.corpora)
        parts = {s.name: c.fingerprint(limit) for s, c in zip(self.mix.sources, self.corpora)}
        return json.dumps(parts, ensure_ascii=False, separators=(",", ":"))

    def content_digest(self) -> str:
        """Corpus.content_digest; a mixture's: one digest over each source's ("": where none has one)."""
        digests = [c.content_digest() for c in self.corpora]
        if self.mix is None or not any(digests):
            return digests[0] if self.mix is None else ""
        return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:32]

    def version_digest(self) -> str:
        """Corpus.version_digest; a mixture's: "<location>:<digest>" over the sources whose objects report
        versions (the location from theirs, the digest from their digests), "" where none does."""
        if self.mix is None:
            return self.corpora[0].version_digest()
        named = self._versioned()
        if not named:
            return ""
        where = hashlib.sha256("\n".join(f"{n}={version_location(v)}" for n, v, _ in named).encode())
        digest = hashlib.sha256("\n".join(f"{n}={v}" for n, v, _ in named).encode())
        return f"{where.hexdigest()[:16]}:{digest.hexdigest()[:32]}"

    def _versioned(self) -> list[tuple[str, str, Corpus]]:
        out = []
        for i, c in enumerate(self.corpora):
            if v := c.version_digest():
                out.append((self.name(i), v, c))
        return out

    def object_versions(self) -> dict[str, str]:
        """Corpus.object_versions; a mixture's: each versioned source's objects, in order, under the
        mixture's location ({} where a source has too many objects to name, or none reports versions)."""
        if self.mix is None:
            return self.corpora[0].object_versions()
        named = self._versioned()
        kept = [c.object_versions().get(version_location(v)) for _, v, c in named]
        if not named or not all(kept):
            return {}
        return {version_location(self.version_digest()): "".join(k or "" for k in kept)}

    def rewritten(self, had: object) -> list[str]:
        """Corpus.rewritten over every versioned source (`had`: object_versions' string)."""
        if self.mix is None:
            return self.corpora[0].rewritten(had)
        if not isinstance(had, str):
            return []
        out, at = [], 0
        for _, v, c in self._versioned():
            n = len(c.object_versions().get(version_location(v), ""))  # OBJECT_DIGEST an object
            out += c.rewritten(had[at : at + n])
            at += n
        return out if at == len(had) else []
