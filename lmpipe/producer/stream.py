"""A shard's deterministic document stream: which documents it owns, in what order, tokenized in batches.

Shard w of n (a "worker" here: the trainer's --shards, served by whichever producer holds it) owns records
with id % n == w. Its good documents are numbered 0, 1, 2, ... in corpus order
and shuffled in fixed windows (a bounded shuffle buffer whose permutation depends only on seed, epoch,
worker and window), so position `pos` names the same document every time: a cursor is just a position.
Sources with random access (the built-in corpus, pre-tokenized shards) get a full seeded permutation.
A worker whose share turns out empty or a single document says so, once per process and corpus for all
the shards like it: that is almost always a corpus split the wrong way (one-sentence-per-line text read as
blank-line blocks) or more producers than documents, and training on it silently would look like a
pipeline bug.

Documents are tokenized a chunk at a time: `encode_batch` records, or fewer whose text reaches CALL_CHARS,
so that the token arrays waiting to be yielded stay small however long the documents. The tokenizer cuts
one long text into pieces itself (shared/tokenizer.py) and calls `keepalive` between its encode calls; a
keepalive that raises (the producer stopping) abandons the chunk and ends that docs() iterator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from lmpipe.producer.scan import SharedScan
from lmpipe.producer.sources import CR_HINT, Corpus, Record
from lmpipe.shared.tokenizer import CALL_CHARS, TokenizerInfo

log = logging.getLogger("lmpipe.producer")
# (corpus, 0 or 1 documents) already reported: a producer holding 15 empty shards of a one-document corpus,
# or 8 one-document shards of an 8-line one, says so once, not in lines that bury the hint
_SAID_LONE: set[tuple[str, int]] = set()


@dataclass
class Doc:
    pos: int  # position in this worker's order for the epoch
    doc_id: int  # record id in the corpus
    ids: np.ndarray  # token ids with the end-of-text token appended
    # uint8 0/1 per token of `ids` (1: trained as a target); None: every token is. The end-of-text token
    # is trained when the document's last token is (a completion's end: the model learns to stop).
    mask: np.ndarray | None = None


@dataclass
class StreamStats:
    documents: int = 0  # tokenized so far (the producer's documents counter reads it)


def permutation(n: int, shuffle: bool, *key: int) -> np.ndarray:
    """A permutation of range(n) that depends only on `key` (identity when not shuffling)."""
    if not shuffle or n <= 1:
        return np.arange(n)
    return np.random.default_rng(list(key)).permutation(n)


class DocStream:
    def __init__(
        self,
        corpus: Corpus,
        tok: TokenizerInfo,
        worker: int = 0,
        num_workers: int = 1,
        *,
        rank: int = 0,
        world_size: int = 1,
        first: int | None = None,
        space: int | None = None,
        seed: int = 0,
        shuffle_window: int = 1000,
        encode_batch: int = 512,
        on_bad: Callable[[str, str, str], None] | None = None,
        on_tokenize: Callable[[float], None] | None = None,
        keepalive: Callable[[], None] | None = None,
        scan: SharedScan | None = None,
    ):
        if not 0 <= worker < num_workers or not 0 <= rank < world_size:
            raise ValueError(f"worker {worker} of {num_workers}, rank {rank} of {world_size}: out of range")
        # rank r's workers own global slots r*num_workers .. (r+1)*num_workers - 1, unless the trainer names
        # them: `first` of `space` (a run resumed on another number of ranks: consumer/reshard.py)
        self.worker_global = (rank * num_workers if first is None else first) + worker
        self.total_workers = world_size * num_workers if space is None else space
        if not 0 <= self.worker_global < self.total_workers:
            raise ValueError(f"global shard {self.worker_global} of {self.total_workers}: out of range")
        self.corpus = corpus
        self.tok = tok
        self.worker = worker
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle_window = shuffle_window
        self.encode_batch = encode_batch
        self.on_bad = on_bad
        self.on_tokenize = on_tokenize  # called with the seconds each chunk of documents took to tokenize
        self.keepalive = keepalive  # called between encode calls: a long document takes many
        self.stats = StreamStats()
        # the producer's one read of a streamed corpus for all the shards it holds (producer/scan.py)
        self.scan = scan if scan is not None and not corpus.random_access else None
        if self.scan is not None and self.scan.total != self.total_workers:
            raise ValueError(
                f"a scan for {self.scan.total} shards cannot serve shard {self.worker_global} of {self.total_workers}"
            )
        # on_bad is told of each bad record once: those up to this record id were told (a pass reads them in
        # id order). A shard restarted mid-pass (a resend) reads from its epoch's start again: its count
        # (the trainer keeps each shard's highest) went on past the shard's bad records, twice those before.
        self._reported_upto = -1
        self._share_checked = False

    def hold(self) -> None:
        """A producer holds this shard: the shared scan keeps its records from the next pass on."""
        if self.scan is not None:
            self.scan.hold(self.worker_global)

    def release(self) -> None:
        """It no longer does (given up, or done with every epoch)."""
        if self.scan is not None:
            self.scan.release(self.worker_global)

    def _check_share(self, n: int) -> None:
        """Warn once when this worker's share of the corpus is empty or a single document."""
        if self._share_checked:
            return
        self._share_checked = True
        if n > 1:
            return
        corpus = self.corpus.describe()[:200]
        owns = "no documents" if n == 0 else "a single document (nothing to shuffle)"
        if (corpus, n) in _SAID_LONE:
            log.debug("shard %d of %d owns %s of %s", self.worker_global, self.total_workers, owns, corpus)
            return
        _SAID_LONE.add((corpus, n))
        hints = ["the corpus has fewer documents than shards"] if n == 0 and self.total_workers > 1 else []
        # only what reading the corpus found (JSONL and tables: a record is a document whatever its lines)
        if self.corpus.cr_endings:
            cr = sorted(self.corpus.cr_endings)
            hints.append(f"{', '.join(cr[:3])}{' and more' if len(cr) > 3 else ''}: {CR_HINT}")
        elif self.corpus.one_document and self.corpus.doc_split in ("blank", "heading"):
            one = sorted(self.corpus.one_document)
            names = f"{', '.join(one[:3])}{' and more' if len(one) > 3 else ''} {'has' if len(one) == 1 else 'have'}"
            if self.corpus.doc_split == "blank":
                hints.append(
                    f"{names} no blank lines: each is one document: for one per line, use --doc-split line"
                )
            else:
                hints.append(f"{names} no ' = Heading = ' lines: each is one document: --doc-split blank ends "
                             "documents at blank lines, line makes one of every line")  # fmt: skip
        if self.total_workers > 1:
            hints.append("said once: other shards like it are not named")
        log.warning(
            "shard %d of %d owns %s of %s%s",
            self.worker_global,
            self.total_workers,
            owns,
            corpus,
            "".join(f"; {h}" for h in hints),
        )

    def _owned(self) -> Iterator[Record]:
        """Good records this worker owns, reporting bad ones once (not every epoch, nor again when the shard
        restarts: only those past the last record reported)."""
        report = self.on_bad
        good = 0
        if self.scan is not None:
            source = self.scan.records(self.worker_global)
        else:
            source = self.corpus.records(self.worker_global, self.total_workers)
        for rec in source:
            new = rec.rid > self._reported_upto
            if new:
                self._reported_upto = rec.rid
            if report is not None and new and rec.warnings:
                for reason, where, detail in rec.warnings:
                    report(reason, where, detail)
            if rec.bad is not None:
                if report is not None and new:
                    report(rec.bad[0], rec.where, rec.bad[1])
                continue
            good += 1
            yield rec
        self._check_share(good)  # a whole pass was read: `good` is this worker's share

    def _ordered(self, epoch: int, start_pos: int) -> Iterator[tuple[int, Record]]:
        """(pos, record) from start_pos on, in this epoch's shuffled order."""
        if self.corpus.random_access:
            owned = self.corpus.owned(self.worker_global, self.total_workers)
            self._check_share(len(owned))
            order = permutation(len(owned), self.shuffle_window > 1, self.seed, epoch, self.worker_global, 1)
            for pos in range(start_pos, len(owned)):
                yield pos, self.corpus.record(owned[order[pos]])
            return
        w = max(1, self.shuffle_window)
        records = self._owned()
        # Windows before the one holding start_pos are read but not kept; nothing is tokenized for them.
        first_window = start_pos // w
        for _ in islice(records, first_window * w):
            pass
        k = first_window
        while True:
            chunk = list(islice(records, w))
            if not chunk:
                return
            order = permutation(len(chunk), True, self.seed, epoch, self.worker_global, 0, k)
            for i, j in enumerate(order):
                pos = k * w + i
                if pos >= start_pos:
                    yield pos, chunk[j]
            k += 1

    def _chunks(self, it: Iterator[tuple[int, Record]]) -> Iterator[list[tuple[int, Record]]]:
        """`encode_batch` records at a time, fewer once their text reaches CALL_CHARS characters."""
        chunk: list[tuple[int, Record]] = []
        size = 0
        for item in it:
            chunk.append(item)
            rec = item[1]
            if rec.ids is None:
                size += len(rec.text or "")
            size += len(rec.prompt or "")
            if len(chunk) >= self.encode_batch or size >= CALL_CHARS:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def docs(self, epoch: int, start_pos: int = 0) -> Iterator[Doc]:
        """Tokenized documents of `epoch` from position `start_pos`, tokenized a chunk at a time."""
        eos = self.tok.eos_id
        for chunk in self._chunks(self._ordered(epoch, start_pos)):
            # (chunk index, text); a prompt/completion record encodes both, the prompt under key -1 - i
            texts = [(i, rec.text or "") for i, (_, rec) in enumerate(chunk) if rec.ids is None]
            texts += [(-1 - i, rec.prompt) for i, (_, rec) in enumerate(chunk) if rec.prompt is not None]
            encoded: dict[int, np.ndarray] = {}
            if texts:
                t0 = time.perf_counter()
                # encoded in Rust, in threads unless TOKENIZERS_PARALLELISM=false, with the GIL released
                ids_of = self.tok.encode_arrays([t for _, t in texts], self.keepalive)
                if self.on_tokenize:
                    self.on_tokenize(time.perf_counter() - t0)
                encoded = {i: ids for (i, _), ids in zip(texts, ids_of)}
            for i, (pos, rec) in enumerate(chunk):
                ids = encoded[i] if rec.ids is None else rec.ids
                mask = None
                if rec.prompt is not None:  # trained: the completion and the end-of-text after it
                    prompt = encoded[-1 - i]
                    mask = np.zeros(len(prompt) + len(ids) + 1, dtype=np.uint8)
                    mask[len(prompt) :] = 1
                    ids = np.concatenate([prompt, ids])
                elif rec.loss_mask is not None:
                    mask = np.empty(len(ids) + 1, dtype=np.uint8)
                    mask[:-1] = rec.loss_mask
                    mask[-1] = mask[-2] if len(ids) else 1
                arr = np.empty(len(ids) + 1, dtype=np.int64)
                arr[:-1] = ids
                arr[-1] = eos
                self.stats.documents += 1
                yield Doc(pos=pos, doc_id=rec.rid, ids=arr, mask=mask)
