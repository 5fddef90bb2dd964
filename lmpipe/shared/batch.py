"""What a batch is, on both sides of the wire.

A batch is `tokens` [B, L] with right padding (`lengths` [B] real tokens per row) and, for packed rows,
`seg` [B, L]: the index of the document each token belongs to within its row, so attention and targets
never cross documents. Three small arrays account for every document piece in the batch (`doc_id`,
`doc_start`, `doc_len`, row-major), which is what lets a test, or a user, prove that nothing was lost or
repeated. The header carries (session, shard, seq) and the cursor after this batch.

A batch of a corpus with loss masks (prompt/completion or ids + loss_mask records) also carries
`loss_mask` [B, L] uint8: 1 where the token is trained as a target (predicted from the tokens before it),
0 where it is context only. Batches without masked documents carry no such array, so plain text pays
nothing for the feature.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lmpipe.shared.wire import CURSOR_KEYS, Limits, Message, WireError, encode


@dataclass(frozen=True, order=True)
class Cursor:
    """Where a shard's deterministic stream stands: epoch, document position in the shard's order,
    token offset inside that document, and batches to skip in the window that starts there (bucket)."""

    epoch: int = 0
    pos: int = 0
    offset: int = 0
    skip: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cursor:
        return cls(**{k: int(d[k]) for k in CURSOR_KEYS})


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else int32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def batch_bytes(cfg) -> int:
    """Upper bound of one batch's array bytes for a PipelineConfig (tokens, seg, loss_mask, lengths, doc
    pieces)."""
    cells = cfg.batch_size * cfg.seq_len
    return cells * (4 + 2 + 1) + cfg.batch_size * 4 + cells * 16


def batch_limits(batch_size: int, seq_len: int) -> Limits:
    """The receiver's wire limits, derived from what a valid batch of up to `batch_size` rows of up to
    `seq_len` tokens can hold. Every document piece has at least one token, so a batch holds at most
    B*T pieces (a corpus of one-token documents); a fixed bound on the piece count rejects valid batches
    of short documents. The largest array is then `doc_id`: B*T int64."""
    cells = batch_size * seq_len
    shapes = {
        "tokens": (batch_size, seq_len),
        "seg": (batch_size, seq_len),
        "loss_mask": (batch_size, seq_len),
        "lengths": (batch_size,),
        "doc_id": (cells,),
        "doc_start": (cells,),
        "doc_len": (cells,),
    }
    return Limits(
        max_ndim=2,
        max_dim=max(batch_size, seq_len, cells),
        max_array_bytes=8 * cells,
        shapes=shapes,
    )


@dataclass
class Batch:
    tokens: np.ndarray  # [B, L] uint16 | int32
    lengths: np.ndarray  # [B] int32
    doc_id: np.ndarray  # [S] int64
    doc_start: np.ndarray  # [S] int32
    doc_len: np.ndarray  # [S] int32
    strategy: str
    cursor: Cursor
    seg: np.ndarray | None = None  # [B, L] uint16, pack only
    loss_mask: np.ndarray | None = None  # [B, L] uint8 0/1, only where some document has a mask

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def pad_tokens(self) -> int:
        return self.rows * self.width - self.real_tokens

    def num_targets(self) -> int:
        """Positions whose next token is in the same document and trained (loss mask 1): what the loss is
        averaged over."""
        if self.seg is None and self.loss_mask is None:
            return int(np.maximum(self.lengths.astype(np.int64) - 1, 0).sum())
        cols = np.arange(self.width - 1)
        valid = cols[None, :] < (self.lengths[:, None] - 1)
        if self.seg is not None:
            valid &= self.seg[:, 1:] == self.seg[:, :-1]
        if self.loss_mask is not None:
            valid &= self.loss_mask[:, 1:] != 0
        return int(valid.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"tokens": self.tokens, "lengths": self.lengths}
        if self.seg is not None:
            out["seg"] = self.seg
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        out.update(doc_id=self.doc_id, doc_start=self.doc_start, doc_len=self.doc_len)
        return out

    def to_frames(self, session: str, shard: int, seq: int, lease: str = "") -> list[Any]:
        """`lease`: the trainer's token for this holder of `shard` (its welcome's), checked on receipt."""
        header = {
            "kind": "batch",
            "session": session,
            "lease": lease,
            "shard": shard,
            "seq": seq,
            "cursor": self.cursor.to_dict(),
            "strategy": self.strategy,
            "counts": {"tokens": self.real_tokens, "pad": self.pad_tokens, "docs": int(self.doc_id.shape[0])},
        }
        return encode(header, self.arrays())


def end_frames(session: str, shard: int, seq: int, cursor: Cursor, lease: str = "") -> list[Any]:
    """The message a shard's holder sends after the shard's last batch of a finite run."""
    return encode(
        {
            "kind": "end",
            "session": session,
            "lease": lease,
            "shard": shard,
            "seq": seq,
            "cursor": cursor.to_dict(),
        }
    )


def _want(msg: Message, name: str, ndim: int, dtypes: tuple[str, ...]) -> np.ndarray:
    arr = msg.arrays.get(name)
    if arr is None:
        raise WireError("bad_batch", f"missing array {name!r}")
    if arr.ndim != ndim or arr.dtype.name not in dtypes:
        raise WireError("bad_batch", f"array {name!r} is {arr.dtype.name}{list(arr.shape)}")
    return arr


def batch_from_message(msg: Message, vocab_size: int, seq_len: int, max_rows: int) -> Batch:
    """Check that a decoded `batch` message is a batch this trainer can train on, and wrap it.

    The wire layer already checked types and sizes; this checks meaning: shapes agree with each other and
    with the trainer's slots, ids are inside the vocabulary, counts add up.
    """
    hdr = msg.header
    tokens = _want(msg, "tokens", 2, ("uint16", "int32"))
    rows, width = tokens.shape
    if not (1 <= rows <= max_rows and 1 <= width <= seq_len):
        raise WireError(
            "bad_batch", f"tokens shape {list(tokens.shape)} exceeds slot [{max_rows}, {seq_len}]"
        )
    lengths = _want(msg, "lengths", 1, ("int32",))
    if lengths.shape[0] != rows or lengths.min() < 0 or lengths.max() > width:
        raise WireError("bad_batch", "lengths do not fit the rows")
    if tokens.size and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        raise WireError("bad_batch", f"token id outside vocabulary of {vocab_size}")
    seg = None
    if hdr["strategy"] == "pack":
        seg = _want(msg, "seg", 2, ("uint16",))
        if seg.shape != tokens.shape or (
            width > 1 and bool((np.diff(seg.astype(np.int32), axis=1) < 0).any())
        ):
            raise WireError("bad_batch", "seg must match tokens and never decrease along a row")
    loss_mask = None
    if "loss_mask" in msg.arrays:
        loss_mask = _want(msg, "loss_mask", 2, ("uint8",))
        if loss_mask.shape != tokens.shape or (loss_mask.size and int(loss_mask.max()) > 1):
            raise WireError("bad_batch", "loss_mask must match tokens and hold only 0 and 1")
    doc_id = _want(msg, "doc_id", 1, ("int64",))
    doc_start = _want(msg, "doc_start", 1, ("int32",))
    doc_len = _want(msg, "doc_len", 1, ("int32",))
    if not (doc_id.shape == doc_start.shape == doc_len.shape):
        raise WireError("bad_batch", "doc_id, doc_start and doc_len differ in length")
    if doc_len.size and (int(doc_len.min()) < 1 or int(doc_start.min()) < 0 or int(doc_id.min()) < 0):
        raise WireError("bad_batch", "document pieces must have ids >= 0, starts >= 0 and >= 1 token")
    real = int(lengths.sum())
    counts = hdr["counts"]
    if (
        int(doc_len.sum(dtype=np.int64)) != real
        or counts["tokens"] != real
        or counts["pad"] != rows * width - real
        or counts["docs"] != doc_id.shape[0]
    ):
        raise WireError("bad_batch", "token counts do not add up")
    # pieces are listed row by row and none crosses a row: every row's end is some piece's end
    row_ends = np.cumsum(lengths, dtype=np.int64)[lengths > 0]
    if row_ends.size and not np.isin(row_ends, np.cumsum(doc_len, dtype=np.int64)).all():
        raise WireError("bad_batch", "document pieces do not line up with the rows")
    return Batch(
        tokens=tokens,
        lengths=lengths,
        seg=seg,
        loss_mask=loss_mask,
        doc_id=doc_id,
        doc_start=doc_start,
        doc_len=doc_len,
        strategy=hdr["strategy"],
        cursor=Cursor.from_dict(hdr["cursor"]),
    )
