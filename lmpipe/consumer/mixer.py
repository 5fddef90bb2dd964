"""The mixer: which source's rows are trained next, decided in one place, by token counts.

A mixture's sources (shared/mix.py) each own `shards_per_source` consecutive shards of the ledger (source
i: shards i*S .. i*S+S-1). For each row of the next training batch the mixer picks the source furthest
behind its target in tokens (Megatron's BlendedDataset rule, counted in tokens: every row adds
weights_at(step)[i] * row_tokens to each source's target and row_tokens to the chosen source's trained
count; ties go to the lower source index). Within a source its open shards take turns one BATCH at a time:
shard j's next batch is sliced row by row until it is used up, then shard j+1's. Nothing here depends on
which producer sent a batch or when: the same data and weights give the same rows in the same order.

The chosen rows are copied into an assembly slot (a pinned HostSlot): tokens, seg (per row, as the model
reads it), lengths, loss_mask and each row's document pieces, with `parts` naming where each run of rows
came from (the doc log's source, shard and seq). A batch counts as consumed (`consumed`: the ledger's
record, its slot released, the shard's credit raised) when its LAST row is taken; the rows already taken of
the batch after the ledger's cursor are in `state_dict()`, so a resumed run skips them in the regenerated
batch and trains the identical sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from lmpipe.consumer.slots import HostSlot, SlotMeta
from lmpipe.shared.batch import Cursor

log = logging.getLogger("lmpipe.trainer")

END = "end"  # fetch(): the shard sent its `end` (finished its epochs)
STOP = "stop"  # fetch(): stop waiting (the run stops): hand out what is assembled
# A schedule moves the weights a little at every step between its points: a line when one moved this much
SAY_MOVE = 0.05


class Weights(Protocol):
    """What the mixer reads of a mixture (shared/mix.py's Mix)."""

    def names(self) -> tuple[str, ...]: ...

    def weights_at(self, step: int) -> tuple[float, ...]: ...


Fetch = Callable[[int], "HostSlot | str"]  # shard -> its next batch's slot, END or STOP (may block)
Consumed = Callable[[int, HostSlot], None]  # shard, the slot of its batch whose last row was taken


@dataclass
class SourceState:
    target: float = 0.0  # tokens it should have had by now
    trained: int = 0  # tokens taken from it
    rr: int = 0  # which of its shards is sliced now (index within the source)
    epoch: int = 0  # the least epoch among its shards' consumed cursors


@dataclass
class Part:
    """A run of rows of one received batch in an assembled batch (the doc log's entry)."""

    source: str
    shard: int
    seq: int
    session: str
    rows: int = 0
    pieces: list[int] = field(default_factory=list)  # [from, to) in the assembled batch's pieces
    targets: int = 0  # its rows' targets


class SourceExhausted(Exception):
    """A source whose every shard ended (its finite epochs) was due next: the run stops."""

    def __init__(self, source: str):
        super().__init__(source)
        self.source = source


class Mixer:
    def __init__(self, mix: Weights, shards_per_source: int, batch_size: int, seq_len: int):
        self.mix, self.S, self.batch_size, self.seq_len = mix, shards_per_source, batch_size, seq_len
        self.names = mix.names()
        n = len(self.names)
        self.sources = [SourceState() for _ in range(n)]
        self.rows_taken = [0] * (n * shards_per_source)  # per shard: rows taken of the batch after its cursor
        self.ended = [False] * (n * shards_per_source)
        self.current: list[HostSlot | None] = [None] * (n * shards_per_source)  # the batch being sliced
        self.step = 0  # the optimizer step the next batch is for (its feed counts them)
        self.exhausted = ""  # the source that ran out, once one did
        self.shard_epochs = [0] * (n * shards_per_source)  # per shard: its consumed cursor's epoch
        self._weights: tuple[float, ...] = ()  # this step's
        self._said_weights: tuple[float, ...] | None = None  # the last said (or the checkpoint's)
        self._resumed = False

    def source_of(self, shard: int) -> int:
        return shard // self.S

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "step": self.step,
            "sources": [
                {"target": s.target, "trained": s.trained, "rr": s.rr, "epoch": s.epoch} for s in self.sources
            ],
            "rows_taken": list(self.rows_taken),
            "weights": list(self._weights),
        }

    def load_state_dict(self, state: dict[str, Any], finished: Sequence[bool] = ()) -> None:
        """Before the first batch. `finished`: the ledger's finished shards (they send nothing more)."""
        names = [str(x) for x in state["names"]]
        if names != list(self.names):
            raise ValueError(f"the checkpoint mixes sources {names}, this run {list(self.names)}")
        rows = [int(x) for x in state["rows_taken"]]
        if len(rows) != len(self.rows_taken) or len(state["sources"]) != len(self.sources):
            raise ValueError(
                f"the checkpoint's mixture has {len(rows)} shards, this run {len(self.rows_taken)}"
            )
        self.step = int(state["step"])
        for s, d in zip(self.sources, state["sources"]):
            s.target, s.trained, s.rr, s.epoch = (
                float(d["target"]),
                int(d["trained"]),
                int(d["rr"]),
                int(d["epoch"]),
            )
        self.rows_taken = rows
        self.ended = [bool(f) for f in finished] or self.ended
        saved = tuple(float(w) for w in state.get("weights") or ())
        self._said_weights, self._resumed = (saved or None), True  # a change is said with the first batch

    # -- choosing rows -------------------------------------------------------------------------------

    def weights(self) -> tuple[float, ...]:
        """This step's weights, said in one line when they differ from the checkpoint's (new weights at
        resume) or, along a schedule, once they moved by SAY_MOVE from the last said."""
        w = tuple(float(x) for x in self.mix.weights_at(self.step))
        said = self._said_weights
        if said is None:
            self._said_weights = w
        elif _moved(said, w, 1e-9 if self._resumed else SAY_MOVE):
            log.info("mixture weights at step %d: %s", self.step, _describe(self.names, said, w))
            self._said_weights = w
        self._resumed = False
        self._weights = w
        return w

    def choose(self) -> int:
        """The source furthest behind its target (ties: the lower index)."""
        best, best_gap = 0, -float("inf")
        for i, s in enumerate(self.sources):
            gap = s.target - s.trained
            if gap > best_gap:
                best, best_gap = i, gap
        return best

    def _next(self, i: int, fetch: Fetch) -> tuple[HostSlot, int, int, bool] | None:
        """Source i's next row: (its batch's slot, row, shard, whether it is the batch's last); None to
        stop. Raises SourceExhausted when every shard of the source ended."""
        S, src = self.S, self.sources[i]
        while True:
            if self.ended[i * S + src.rr]:
                open_ = [j for j in range(S) if not self.ended[i * S + j]]
                if not open_:
                    raise SourceExhausted(self.names[i])
                src.rr = next((j for j in open_ if j > src.rr), open_[0])
            shard = i * S + src.rr
            slot = self.current[shard]
            if slot is None:
                got = fetch(shard)
                if got == STOP:
                    return None
                if not isinstance(got, HostSlot):  # END: it finished its epochs
                    self.ended[shard], self.rows_taken[shard] = True, 0
                    continue
                slot = self.current[shard] = got
            assert slot.meta is not None
            r = self.rows_taken[shard]
            last = r + 1 >= slot.meta.rows
            if last:  # the next batch is the next shard's
                self.current[shard], self.rows_taken[shard] = None, 0
                src.rr = (src.rr + 1) % S
            else:
                self.rows_taken[shard] = r + 1
            return slot, r, shard, last

    def assemble(self, out: HostSlot, fetch: Fetch, consumed: Consumed, session: str) -> int:
        """Fill `out` with up to batch_size rows and return how many (0: none). Fewer when fetch says stop,
        or when a source due next has no data left (`exhausted` then names it)."""
        w = self.weights()
        asm = _Assembly(out, self.seq_len)
        while asm.rows < self.batch_size and not self.exhausted:
            i = self.choose()
            try:
                got = self._next(i, fetch)
            except SourceExhausted as exc:
                self.exhausted = exc.source
                break
            if got is None:
                break
            slot, r, shard, last = got
            assert slot.meta is not None
            if (
                r < slot.meta.rows and RowIndex.of(slot).lengths[r] > 0
            ):  # an empty row carries nothing: skipped
                n = asm.add(slot, r, self.names[i], shard)
                for k, s in enumerate(self.sources):
                    s.target += w[k] * n
                self.sources[i].trained += n
            if last:
                asm.flush()  # its rows are copied before its slot goes back
                self._epoch(i, shard, slot.meta.cursor)
                consumed(shard, slot)
        asm.finish(session)
        return asm.rows

    # -- epochs --------------------------------------------------------------------------------------

    def set_epochs(self, epochs: Sequence[int]) -> None:
        """Each shard's epoch from the ledger's cursors (at resume)."""
        self.shard_epochs = [int(e) for e in epochs]
        for i, s in enumerate(self.sources):
            s.epoch = min(self.shard_epochs[i * self.S : (i + 1) * self.S])

    def _epoch(self, i: int, shard: int, cursor: Cursor) -> None:
        self.shard_epochs[shard] = cursor.epoch
        e = min(self.shard_epochs[i * self.S : (i + 1) * self.S])
        if e > self.sources[i].epoch:
            self.sources[i].epoch = e
            log.info("source %s: every shard is past epoch %d; now in epoch %d", self.names[i], e - 1, e)

    def shares(self) -> dict[str, dict[str, float]]:
        """Per source: tokens trained, realized share, this step's target share, epoch (the summary's)."""
        total = sum(s.trained for s in self.sources)
        w = self._weights or tuple(float(x) for x in self.mix.weights_at(self.step))
        return {
            n: {
                "tokens": s.trained,
                "share": s.trained / total if total else 0.0,
                "target": w[i],
                "epoch": s.epoch,
            }
            for i, (n, s) in enumerate(zip(self.names, self.sources))
        }


def _moved(old: Sequence[float], new: Sequence[float], by: float) -> bool:
    return len(old) != len(new) or any(abs(a - b) >= by for a, b in zip(old, new))


def _describe(names: Sequence[str], old: Sequence[float], new: Sequence[float]) -> str:
    if len(old) != len(new):
        old = [float("nan")] * len(new)
    return ", ".join(f"{n} {a:.3g} -> {b:.3g}" for n, a, b in zip(names, old, new))


@dataclass
class RowIndex:
    """A received batch's rows as the mixer reads them, made once per batch: each row's real tokens and
    the end of its document pieces (pieces are row-major and none crosses a row: checked on receipt), and
    the pieces as one [k, 3] array (doc_id, doc_start, doc_len)."""

    lengths: list[int]
    ends: list[int]
    pieces: np.ndarray

    @classmethod
    def of(cls, slot: HostSlot) -> RowIndex:
        m = slot.meta
        assert m is not None
        if m.row_index is None:
            lengths = slot._np_lengths[: m.rows]
            ends = np.searchsorted(
                np.cumsum(m.doc_len, dtype=np.int64), np.cumsum(lengths, dtype=np.int64), "right"
            )
            pieces = np.stack([m.doc_id, m.doc_start.astype(np.int64), m.doc_len.astype(np.int64)], axis=1)
            m.row_index = cls(lengths.tolist(), ends.tolist(), pieces)
        return m.row_index


class _Assembly:
    """Rows copied into an assembly slot: laid out at a stride of seq_len, then compacted to the widest
    row's batch width (pack: always seq_len, nothing moves). Consecutive rows of one received batch form a
    run, copied in one go when the run ends (flush: before its batch's slot is released). seg is per row
    in every batch (the index of the document within its row, as the model reads it): a row keeps its own."""

    def __init__(self, out: HostSlot, seq_len: int):
        self.out, self.T = out, seq_len
        self.rows = 0
        self.runs: list[tuple[int, int, bool]] = []  # per run: rows, width, loss-masked
        self.pieces: list[np.ndarray] = []  # per run: its rows' pieces, [k, 3]
        self.row_pieces: list[int] = []  # per row: how many pieces it holds
        self.npieces = 0
        self.parts: list[Part] = []
        self.strategy = ""
        self.has_seg = False
        self._open: tuple[HostSlot, int, RowIndex] | None = None  # the run being added to: slot, first row

    def add(self, slot: HostSlot, r: int, source: str, shard: int) -> int:
        """Add row r of `slot` (copied at the end of its run); its real tokens."""
        run = self._open
        if run is None or run[0] is not slot or r != run[1] + self.parts[-1].rows:
            self.flush()
            m = slot.meta
            assert m is not None
            run = self._open = (slot, r, RowIndex.of(slot))
            self.parts.append(Part(source, shard, m.seq, m.session))
        self.parts[-1].rows += 1
        self.rows += 1
        return run[2].lengths[r]

    def flush(self) -> None:
        """Copy the open run: tokens, seg, loss mask and lengths, and its pieces."""
        if self._open is None:
            return
        slot, r0, ix = self._open
        self._open = None
        m, out, T, p = slot.meta, self.out, self.T, self.parts[-1]
        assert m is not None
        n, W, k0 = p.rows, m.width, self.rows - p.rows
        arrays = [(out._np_tokens, slot._np_tokens)]
        if slot.has_seg:
            arrays.append((out._np_seg, slot._np_seg))
        if slot.has_loss_mask:
            arrays.append((out._np_loss_mask, slot._np_loss_mask))
        if W == T:  # n whole rows: one block
            for dst, src in arrays:
                dst[k0 * T : (k0 + n) * T] = src[r0 * T : (r0 + n) * T]
        else:
            for dst, src in arrays:
                dst[: self.rows * T].reshape(-1, T)[k0:, :W] = src[: m.rows * W].reshape(-1, W)[r0 : r0 + n]
            out._np_tokens[: self.rows * T].reshape(-1, T)[k0:, W:] = 0
        out._np_lengths[k0 : self.rows] = ix.lengths[r0 : r0 + n]
        a = ix.ends[r0 - 1] if r0 else 0
        b = ix.ends[r0 + n - 1]
        self.pieces.append(ix.pieces[a:b])
        prev = a
        for e in ix.ends[r0 : r0 + n]:
            self.row_pieces.append(e - prev)
            prev = e
        p.pieces = [self.npieces, self.npieces + b - a]
        self.npieces += b - a
        self.runs.append((n, W, slot.has_loss_mask))
        self.strategy, self.has_seg = m.strategy, slot.has_seg

    def finish(self, session: str) -> None:
        self.flush()
        out, T, B = self.out, self.T, self.rows
        if not B:
            out.meta = None
            return
        W = max(w for _, w, _ in self.runs)
        masked = any(has for _, _, has in self.runs)
        if masked:  # rows of batches without a mask train every target
            k = 0
            for n, _, has in self.runs:
                if not has:
                    out._np_loss_mask[k * T : (k + n) * T] = 1
                k += n
        if W < T:  # forward, row by row: each row's new place starts before its old one
            for a in [out._np_tokens] + [out._np_seg] * self.has_seg + [out._np_loss_mask] * masked:
                for k in range(1, B):
                    a[k * W : (k + 1) * W] = a[k * T : k * T + W]
        out.has_seg, out.has_loss_mask = self.has_seg, masked
        pieces = np.concatenate(self.pieces) if self.pieces else np.zeros((0, 3), np.int64)
        lengths = out._np_lengths[:B]
        if masked:
            n = B * W
            seg = out._np_seg[:n].reshape(B, W) if self.has_seg else None
            per_row: list[int] = _row_targets(lengths, seg, out._np_loss_mask[:n].reshape(B, W)).tolist()
        else:  # a row of k pieces has a target at every token but each piece's last
            per_row = [max(n - k, 0) for n, k in zip(lengths.tolist(), self.row_pieces)]
        k = 0
        for p in self.parts:
            p.targets = int(sum(per_row[k : k + p.rows]))
            k += p.rows
        real = int(lengths.sum())
        out.meta = SlotMeta(
            shard=-1, seq=0, session=session, cursor=Cursor(), strategy=self.strategy, rows=B, width=W,
            real_tokens=real, pad_tokens=B * W - real, n_targets=int(sum(per_row)), doc_id=pieces[:, 0].copy(),
            doc_start=pieces[:, 1].astype(np.int32), doc_len=pieces[:, 2].astype(np.int32), parts=self.parts,
        )  # fmt: skip


def _row_targets(lengths: np.ndarray, seg: np.ndarray | None, loss_mask: np.ndarray | None) -> np.ndarray:
    """Per row, the targets the loss is taken on (Batch.num_targets, row by row)."""
    if seg is None and loss_mask is None:
        return np.maximum(lengths.astype(np.int64) - 1, 0)
    W = (seg if seg is not None else loss_mask).shape[1]  # type: ignore[union-attr]
    valid = np.arange(W - 1)[None, :] < (lengths[:, None] - 1)
    if seg is not None:
        valid &= seg[:, 1:] == seg[:, :-1]
    if loss_mask is not None:
        valid &= loss_mask[:, 1:] != 0
    return valid.sum(axis=1)
