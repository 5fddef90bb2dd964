"""The mixer (consumer/mixer.py) in-process, on host slots filled from real producer batches: token shares
within one row of the weights (fixed and along a schedule), the same row sequence after a state round trip
(the rows already taken of a batch skipped in its regenerated copy), a source running out, a weight change
at resume said in one line, and rows of other widths and loss masks copied as they were."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lmpipe.consumer.mixer import END, Mixer
from lmpipe.consumer.slots import HostSlot
from lmpipe.producer.batching import BatchSpec
from lmpipe.shared.batch import Batch
from tests.mixtures import B, FixedMix, S, T, rows_of, shard_batches


class Feed:
    """Each shard's batches as host slots, in order, from `start` (a resumed cursor: the seq consumed)."""

    def __init__(self, streams: dict[int, list[Batch]], start: dict[int, int] | None = None, pack=True):
        self.streams, self.next = streams, dict(start or {s: 0 for s in streams})
        self.consumed: list[tuple[int, int]] = []

    def fetch(self, shard: int) -> HostSlot | str:
        i = self.next[shard]
        if i >= len(self.streams[shard]):
            return END
        self.next[shard] = i + 1
        slot = HostSlot(B, T, np.dtype("<u2"), pin=False)
        slot.fill(self.streams[shard][i], shard, i + 1, "s", 0.0)
        return slot

    def done(self, shard: int, slot: HostSlot) -> None:
        assert slot.meta is not None
        self.consumed.append((shard, slot.meta.seq))


def assembled(out: HostSlot) -> Batch:
    """The assembled slot as a Batch, to count its targets as a received batch's are counted."""
    m = out.meta
    tokens, lengths, seg = out.views()
    mask = out.loss_mask_view()
    return Batch(tokens.numpy(), lengths.numpy(), m.doc_id, m.doc_start, m.doc_len, m.strategy, m.cursor,
                 None if seg is None else seg.numpy(), None if mask is None else mask.numpy())  # fmt: skip


def run(mixer: Mixer, feed: Feed, n: int) -> list[tuple[int, ...]]:
    rows = []
    for _ in range(n):
        out = HostSlot(B, T, np.dtype("<u2"), pin=False)
        got = mixer.assemble(out, feed.fetch, feed.done, "s")
        if not got:
            break
        mixer.step += 1
        rows += rows_of(out)
    return rows


def pack_streams(sources: int, ndocs: int = 400) -> dict[int, list[Batch]]:
    spec = BatchSpec(strategy="pack", seq_len=T, batch_size=B)
    return {s: shard_batches(s, ndocs, spec) for s in range(sources * S)}


def test_token_shares_stay_within_one_row_of_the_weights() -> None:
    mix = FixedMix((0.6, 0.3, 0.1))
    mixer, feed = Mixer(mix, S, B, T), Feed(pack_streams(3))
    for _ in range(40):
        out = HostSlot(B, T, np.dtype("<u2"), pin=False)
        assert mixer.assemble(out, feed.fetch, feed.done, "s") == B
        mixer.step += 1
        total = sum(s.trained for s in mixer.sources)
        for w, s in zip(mix.weights_at(0), mixer.sources):
            assert abs(s.trained - w * total) <= T, (s.trained, w * total)
        m = out.meta
        assert m is not None and m.real_tokens == sum(len(r) for r in rows_of(out))
        assert m.n_targets == assembled(out).num_targets()  # what the loss is averaged over
        assert sum(p.rows for p in m.parts) == B  # every row named by its source's part
    assert [round(s.trained / total, 2) for s in mixer.sources] == [0.6, 0.3, 0.1]
    # round robin within a source, one batch at a time: web's shards 0 and 1 alternate
    web = [shard for shard, _ in feed.consumed if shard < S]
    assert web[:6] == [0, 1, 0, 1, 0, 1]


def test_a_schedule_keeps_every_source_within_one_row_of_its_moving_target() -> None:
    mix = FixedMix((1, 1), schedule=((0, (0.9, 0.1)), (10, (0.2, 0.8))))
    mixer, feed = Mixer(mix, S, B, T), Feed(pack_streams(2))
    expected = [0.0, 0.0]
    for step in range(30):
        out = HostSlot(B, T, np.dtype("<u2"), pin=False)
        mixer.assemble(out, feed.fetch, feed.done, "s")
        mixer.step += 1
        w = mix.weights_at(step)
        tokens = out.meta.real_tokens
        expected = [e + wi * tokens for e, wi in zip(expected, w)]
        for e, s in zip(expected, mixer.sources):
            assert abs(s.target - e) < 1e-6 and abs(s.trained - e) <= T
    web_early = mixer.sources[0].trained  # mostly web first, mostly code later
    assert web_early / sum(s.trained for s in mixer.sources) < 0.9


def test_state_round_trip_reproduces_the_same_rows_skipping_those_taken() -> None:
    mix = FixedMix((0.5, 0.3, 0.2))
    streams = pack_streams(3)
    whole = run(Mixer(mix, S, B, T), Feed(streams), 25)
    first, feed = Mixer(mix, S, B, T), Feed(streams)
    head = run(first, feed, 11)
    state = first.state_dict()
    assert any(state["rows_taken"]), "a batch is half-taken at the save: its rows are skipped on resume"
    consumed = {s: 0 for s in streams}
    for shard, seq in feed.consumed:
        consumed[shard] = seq
    again = Mixer(mix, S, B, T)
    again.load_state_dict(state)
    tail = run(again, Feed(streams, start=consumed), 14)
    assert head + tail == whole


def test_a_source_that_runs_out_is_named() -> None:
    spec = BatchSpec(strategy="pack", seq_len=T, batch_size=B)
    streams = {s: shard_batches(s, 400 if s < S else 6, spec) for s in range(2 * S)}
    mixer, feed = Mixer(FixedMix((0.5, 0.5)), S, B, T), Feed(streams)
    rows = run(mixer, feed, 100)
    assert mixer.exhausted == "code"
    code_tokens = sum(int(b.lengths.sum()) for s in range(S, 2 * S) for b in streams[s])
    assert mixer.sources[1].trained == code_tokens  # every row it had, then the stop
    assert len(rows) < 100 * B


def test_a_weight_change_at_resume_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    streams = pack_streams(2)
    first, feed = Mixer(FixedMix((0.5, 0.5)), S, B, T), Feed(streams)
    run(first, feed, 5)
    again = Mixer(FixedMix((0.8, 0.2)), S, B, T)
    again.load_state_dict(first.state_dict())
    consumed = {s: 0 for s in streams}
    for shard, seq in feed.consumed:
        consumed[shard] = seq
    with caplog.at_level(logging.INFO, "lmpipe.trainer"):
        run(again, Feed(streams, start=consumed), 20)
    lines = [r.getMessage() for r in caplog.records if "mixture weights" in r.getMessage()]
    assert lines == ["mixture weights at step 5: web 0.5 -> 0.8, code 0.5 -> 0.2"]
    total = sum(s.trained for s in again.sources)
    assert abs(again.sources[0].trained - again.sources[0].target) <= T
    assert again.sources[0].trained / total > 0.6


def test_rows_of_other_widths_and_loss_masks_are_copied_as_they_were() -> None:
    spec = BatchSpec(strategy="pad-batch", seq_len=T, batch_size=B)
    streams = {s: shard_batches(s, 60, spec) for s in range(2 * S)}
    for s in range(S, 2 * S):  # the second source's batches carry loss masks
        for b in streams[s]:
            b.loss_mask = (np.arange(b.width)[None, :] % 2 == 0).repeat(b.rows, 0).astype(np.uint8)
    mixer, feed = Mixer(FixedMix((0.5, 0.5)), S, B, T), Feed(streams)
    out = HostSlot(B, T, np.dtype("<u2"), pin=False)
    mixer.assemble(out, feed.fetch, feed.done, "s")
    m = out.meta
    tokens, lengths, seg = out.views()
    assert seg is None and m.width == tokens.shape[1] <= T
    mask = out.loss_mask_view()
    assert mask is not None
    k, taken = 0, {}
    for p in m.parts:  # each row is its batch's row, tokens and mask as sent
        src = streams[p.shard][p.seq - 1]
        for _ in range(p.rows):
            r = taken[p.shard, p.seq] = taken.get((p.shard, p.seq), -1) + 1
            n = int(src.lengths[r])
            assert int(lengths[k]) == n and tokens[k, :n].tolist() == src.tokens[r, :n].tolist()
            if src.loss_mask is not None:
                assert mask[k, :n].tolist() == src.loss_mask[r, :n].tolist()
            k += 1
    web_rows = [k for k, p in enumerate(x for p in m.parts for x in [p] * p.rows) if p.source == "web"]
    for k in web_rows:  # rows without a mask train every target
        assert bool(mask[k, : int(lengths[k])].all())
    assert m.n_targets == assembled(out).num_targets() < m.real_tokens
