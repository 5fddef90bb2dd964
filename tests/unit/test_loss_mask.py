"""Loss masks: prompt/completion and ids + loss_mask records, the mask through batching, the wire and the
host slots, targets that skip masked tokens (exactly zero gradient), exact accumulation, and real runs
(plain and from prepared shards) that train every document once and take the loss on exactly the unmasked
targets."""

from __future__ import annotations

import contextlib
import copy
import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.feed import DeviceFeed
from lmpipe.consumer.inputs import MaskCache
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.model import IGNORE
from lmpipe.consumer.receiver import Receiver
from lmpipe.consumer.slots import HostSlot
from lmpipe.consumer.step import StepRunner
from lmpipe.producer import batching
from lmpipe.producer.batching import BatchSpec, batches
from lmpipe.producer.shards import ShardSet
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import Doc, DocStream
from lmpipe.shared.batch import Batch, batch_from_message, batch_limits
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics
from lmpipe.shared.wire import WireError, decode, encode
from tests.helpers import (
    ListStream,
    free_port_pair,
    tiny_model,
)


class MaskedStream(ListStream):
    """In-memory documents, each with a 0/1 mask per token or None (every token trained)."""

    def __init__(self, docs: list[list[int]], masks: list[list[int] | None]):
        super().__init__(docs)
        self.masks_ = [None if m is None else np.array(m, dtype=np.uint8) for m in masks]

    def docs(self, epoch: int, start_pos: int = 0):
        for d in super().docs(epoch, start_pos):
            yield Doc(pos=d.pos, doc_id=d.doc_id, ids=d.ids, mask=self.masks_[d.pos])


def as_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def over_the_wire(b: Batch, seq_len: int, rows: int) -> Batch:
    """The batch as the trainer's receiver sees it: encoded, decoded under the run's limits, checked."""
    msg = decode(as_bytes(b.to_frames("s", 0, 1)), batch_limits(rows, seq_len))
    return batch_from_message(msg, vocab_size=600, seq_len=seq_len, max_rows=rows)


def test_prompt_completion_and_masked_ids_records_become_masked_documents(tmp_path, tok):
    path = tmp_path / "ft.jsonl"
    good = [
        {"prompt": "Question: what is two and two?\nAnswer:", "completion": " four"},
        {"ids": [11, 12, 13, 14, 15], "loss_mask": [0, 0, 1, 1, 0]},
        {"text": "a plain document trains every token"},
        {"prompt": "", "completion": "no prompt at all"},
    ]
    bad = [
        ({"prompt": "only a prompt"}, "bad_prompt", "completion is missing"),
        (
            {"text": "t", "prompt": "p"},
            "bad_prompt",
            'completion is missing); a plain "text" record has neither',
        ),
        ({"prompt": ["x"], "completion": "y"}, "bad_prompt", "prompt is list"),
        ({"prompt": "p", "completion": "   "}, "empty", "empty completion"),
        ({"ids": [1, 2, 3], "loss_mask": [1, 1]}, "bad_mask", "list of 3 values (one per id), not 2"),
        ({"ids": [1, 2], "loss_mask": [1, 2]}, "bad_mask", "0 or 1"),
        ({"ids": [1, 2], "loss_mask": [True, False]}, "bad_mask", "0 or 1"),
        ({"text": "t", "loss_mask": [1]}, "bad_mask", 'needs an "ids" list'),
        ({"ids": [1, 10**9], "loss_mask": [1, 1]}, "bad_ids", "ids must be integers"),
        ({"title": "neither"}, "missing_text", '"prompt" and "completion"'),
        # Hugging Face's targets (-100: not trained) are not read: never every id trained unsaid
        (
            {"ids": [1, 2, 3], "labels": [-100, 2, 3]},
            "bad_mask",
            '"labels" is not read: write {"ids": [...], '
            '"loss_mask": [...]} (loss_mask 0 where labels is -100, else 1) or {"prompt": "...", "completion"',
        ),
        ({"input_ids": [1, 2], "labels": [1, 2]}, "bad_mask", '"labels" is not read'),
    ]
    lines = (
        [json.dumps(r) for r in good[:2]]
        + [json.dumps(r) for r, _, _ in bad]
        + [json.dumps(r) for r in good[2:]]
    )
    path.write_text("\n".join(lines) + "\n")
    reported = []
    stream = DocStream(
        Corpus([str(path)], vocab_size=tok.vocab_size), tok, shuffle_window=0,
        on_bad=lambda reason, where, detail: reported.append((reason, where, detail)),
    )  # fmt: skip
    docs = list(stream.docs(0))
    assert [(r, w) for r, w, _ in reported] == [(r, f"{path}:{3 + i}") for i, (_, r, _) in enumerate(bad)]
    for (_, _, detail), (_, _, want) in zip(reported, bad):
        assert want in detail
    assert [d.doc_id for d in docs] == [0, 1, 2 + len(bad), 3 + len(bad)]
    eos = tok.eos_id

    enc = tok.tokenizer.encode_batch([good[0]["prompt"], good[0]["completion"]], add_special_tokens=False)
    prompt, completion = enc[0].ids, enc[1].ids
    assert docs[0].ids.tolist() == prompt + completion + [eos]
    # the prompt is context only; the completion and the end-of-text after it are trained
    assert docs[0].mask.tolist() == [0] * len(prompt) + [1] * (len(completion) + 1)
    assert docs[1].ids.tolist() == [11, 12, 13, 14, 15, eos]
    assert docs[1].mask.tolist() == [0, 0, 1, 1, 0, 0], "end-of-text is trained as the last token is"
    assert docs[2].mask is None
    assert docs[3].mask.tolist() == [1] * len(docs[3].ids)


masked_docs = st.lists(
    st.tuples(
        st.lists(st.integers(1, 500), min_size=1, max_size=60),
        st.one_of(st.none(), st.randoms(use_true_random=False)),
    ),
    min_size=1,
    max_size=30,
)
specs = st.builds(
    BatchSpec,
    strategy=st.sampled_from(["pad", "pad-batch", "bucket", "pack"]),
    seq_len=st.integers(2, 40),
    batch_size=st.integers(1, 5),
    bucket_k=st.integers(0, 10),
    bucket_window=st.integers(1, 20),
    pad_multiple=st.sampled_from([1, 8]),
    seed=st.integers(0, 3),
)


def _split(raw) -> tuple[list[list[int]], list[list[int] | None]]:
    docs = [d for d, _ in raw]
    masks = [None if r is None else [r.randint(0, 1) for _ in d] for d, r in raw]
    return docs, masks


@settings(max_examples=150, deadline=None)
@given(raw=masked_docs, spec=specs)
def test_the_mask_travels_aligned_with_its_tokens(raw, spec):
    """Every strategy cuts and lays out the mask exactly as the tokens, through the wire; pad is 0;
    the batch's target count is the trained targets inside its document pieces."""
    docs, masks = _split(raw)
    any_masked = any(m is not None for m in masks)
    out = list(batches(MaskedStream(docs, masks), spec, epochs=1))
    seen = {}
    for sent in out:
        b = over_the_wire(sent, spec.seq_len, spec.batch_size)
        holds_masked = any(masks[int(d) - 1000] is not None for d in b.doc_id)
        if not holds_masked:  # plain batches stay as they were: no mask array at all
            assert b.loss_mask is None and "loss_mask" not in sent.arrays()
            continue
        assert b.loss_mask is not None and b.loss_mask.dtype == np.uint8
        expected_targets = 0
        k = 0
        for r in range(b.rows):
            fill = 0
            while fill < b.lengths[r]:
                did, start, n = int(b.doc_id[k]), int(b.doc_start[k]), int(b.doc_len[k])
                m = masks[did - 1000]
                want = np.ones(n, np.uint8) if m is None else np.array(m[start : start + n], np.uint8)
                np.testing.assert_array_equal(b.loss_mask[r, fill : fill + n], want)
                np.testing.assert_array_equal(
                    b.tokens[r, fill : fill + n], docs[did - 1000][start : start + n]
                )
                seen.setdefault(did, []).append(start)
                expected_targets += int(want[1:].sum())
                fill += n
                k += 1
                if b.seg is None:
                    break
            assert (b.loss_mask[r, b.lengths[r] :] == 0).all(), "pad is never trained"
        assert b.num_targets() == expected_targets
    if not any_masked:
        assert all(b.loss_mask is None for b in out)


def _same(a: Batch, b: Batch) -> bool:
    arrays = a.arrays().keys() == b.arrays().keys() and all(
        np.array_equal(x, b.arrays()[k]) for k, x in a.arrays().items()
    )
    return arrays and a.cursor == b.cursor


def test_pack_starts_a_row_with_a_prompt_that_would_be_cut():
    """A prompt/completion cut at a row end trained its completion without the prompt in view (41% of the
    trained targets of a fine-tuning corpus at the default --seq-len 128). One that fits in a row now
    starts the next row; plain documents, all-ones masks and documents longer than a row pack as before."""
    docs = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14], list(range(15, 25)), [25, 26]]
    masks = [None, [0, 0, 1, 1], [1] * 5, [0] * 5 + [1] * 5, None]
    (b,) = batches(MaskedStream(docs, masks), BatchSpec(strategy="pack", seq_len=8, batch_size=4), epochs=1)
    assert b.lengths.tolist() == [5, 8, 8, 5]
    assert b.tokens[0, :5].tolist() == docs[0] and b.tokens[1, :4].tolist() == docs[1], "prompt starts row 1"
    assert b.tokens[1, 4:].tolist() == docs[2][:4] and b.tokens[2, 0] == 14, "all ones: cut as plain text"
    assert b.tokens[2, 1:].tolist() == docs[3][:7], "longer than a row: cut as before (and said once)"
    assert b.loss_mask[0].tolist() == [1] * 5 + [0] * 3, "the row's pad is never trained"
    assert b.seg[0].tolist() == [0] * 5 + [1] * 3 and b.num_targets() == 4 + 5 + 2 + 3


@settings(max_examples=100, deadline=None)
@given(raw=masked_docs, seq_len=st.integers(2, 24), rows=st.integers(1, 4))
def test_pack_resumes_at_any_cursor_to_the_same_batches(raw, seq_len, rows):
    """The row padded out before a prompt can end a batch: its cursor (the prompt, not yet taken) makes
    exactly the batches that came next, as every other cursor does."""
    docs, masks = _split(raw)
    spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=rows)
    out = list(batches(MaskedStream(docs, masks), spec, epochs=2))
    for i in range(1, len(out)):
        again = list(batches(MaskedStream(docs, masks), spec, start=out[i - 1].cursor, epochs=2))
        assert len(again) == len(out) - i and all(_same(a, b) for a, b in zip(again, out[i:])), i


def test_a_mask_on_an_unmasked_batch_changes_nothing():
    """The same documents with all-ones masks: the same tokens and target counts as with none."""
    docs = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    for strategy in ("pad-batch", "pack"):
        spec = BatchSpec(strategy=strategy, seq_len=8, batch_size=2)
        plain = list(batches(ListStream(docs), spec, epochs=1))
        ones = list(batches(MaskedStream(docs, [[1] * len(d) for d in docs]), spec, epochs=1))
        assert [b.num_targets() for b in plain] == [b.num_targets() for b in ones]
        for a, b in zip(plain, ones):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            assert a.loss_mask is None and b.loss_mask is not None


@pytest.mark.parametrize("strategy", ["pack", "pad", "bucket"])
def test_a_masked_document_longer_than_a_row_is_said_once(strategy, caplog, monkeypatch):
    """A prompt longer than --seq-len is cut into rows, and its completion is trained without the start of
    the prompt in view: worth one warning per process. An unmasked long document is ordinary text."""
    monkeypatch.setattr(
        batching, "_said_long_masked", False, raising=False
    )  # as in a producer that has said nothing yet
    long_plain, long_masked, short_masked = list(range(1, 21)), list(range(1, 21)), [1, 2, 3]
    stream = MaskedStream(
        [long_plain, short_masked, long_masked, long_masked],
        [None, [0, 1, 1], [0] * 15 + [1] * 5, [0] * 15 + [1] * 5],
    )
    spec = BatchSpec(strategy=strategy, seq_len=8, batch_size=2, bucket_window=8)
    with caplog.at_level("WARNING", logger="lmpipe.producer"):
        ones = MaskedStream([long_plain, long_plain, short_masked], [None, [1] * 20, [0, 1, 1]])
        list(batches(ones, spec, epochs=1))
        assert not caplog.records, "a long document without a prompt and a short one with one are fine"
        list(batches(stream, spec, epochs=2))
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 1 and "document 1002 has loss-masked tokens and 20 in all, over --seq-len 8" in said[0]
    )


@pytest.mark.parametrize("strategy", ["pack", "pad", "bucket"])
def test_the_long_prompt_warning_is_said_once_per_process_not_per_shard(strategy, caplog, monkeypatch):
    """A producer batches a stream per shard it holds: the warning marked "(said once)" was said by each
    (16 times in a 10-step run of 500-token prompts at --seq-len 128, 41 with --shards 256), though the
    README says each producer warns once."""
    monkeypatch.setattr(batching, "_said_long_masked", False, raising=False)
    spec = BatchSpec(strategy=strategy, seq_len=8, batch_size=2, bucket_window=8)
    with caplog.at_level("WARNING", logger="lmpipe.producer"):
        for shard in range(4):  # a shard's stream each, as a producer holding 4 shards
            docs = [list(range(1, 21)), [1, 2, 3]]
            stream = MaskedStream(docs, [[0] * 15 + [1] * 5, [0, 1, 1]])
            stream.worker = shard
            list(batches(stream, spec, epochs=1))
    said = [r.getMessage() for r in caplog.records if "has loss-masked tokens" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("(said once)"), said


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a: a.update(loss_mask=a["loss_mask"].astype(np.int32)), "array 'loss_mask' is int32"),
        (lambda a: a.update(loss_mask=a["loss_mask"][:, :-1].copy()), "loss_mask must match tokens"),
        (lambda a: a.update(loss_mask=a["loss_mask"] * 2), "only 0 and 1"),
    ],
)
def test_a_bad_loss_mask_is_rejected(change, reason):
    (b,) = list(
        batches(MaskedStream([[1, 2, 3, 4, 5], [6, 7, 8]], [[0, 1, 1, 1, 1], None]),
                BatchSpec(strategy="pack", seq_len=8, batch_size=1), epochs=1)
    )  # fmt: skip
    arrays = b.arrays()
    change(arrays)
    hdr = {"kind": "batch", "session": "s", "shard": 0, "seq": 1, "cursor": b.cursor.to_dict(),
           "strategy": "pack", "counts": {"tokens": b.real_tokens, "pad": b.pad_tokens, "docs": 2}}  # fmt: skip
    msg = decode(as_bytes(encode(hdr, arrays)), batch_limits(1, 8))
    with pytest.raises(WireError, match=reason):
        batch_from_message(msg, vocab_size=100, seq_len=8, max_rows=1)
    big = dict(b.arrays(), loss_mask=np.zeros((1, 9), np.uint8))
    with pytest.raises(WireError, match="'loss_mask' has shape"):  # over the slot: refused before it is read
        decode(as_bytes(encode(hdr, big)), batch_limits(1, 8))


@contextlib.contextmanager
def trainer_feed(rows: int, seq_len: int, strategy: str, device: str = "cpu"):
    """The trainer's receive side, started, and its device feed: `inputs(batch)` decodes a batch's frames
    under the receiver's own limits into one of its host slots and makes the model inputs of it."""
    cfg = PipelineConfig(
        batch_size=rows, seq_len=seq_len, strategy=strategy, producers=1, port=free_port_pair()
    )
    slots = [HostSlot(rows, seq_len, np.dtype("<u2"), pin=device == "cuda") for _ in range(2)]
    table, metrics = Ledger(1, "s"), TrainerMetrics(CollectorRegistry())
    receiver = Receiver(cfg, {}, slots, table, metrics, 600)
    receiver.start()
    receiver.bound.wait()
    assert receiver.error is None, receiver.error
    feed = DeviceFeed(receiver, table, metrics, torch.device(device), copy_stream=device == "cuda",
                      rows=None, attention="dense", mask_cache=MaskCache())  # fmt: skip
    free = list(slots)

    def inputs(b: Batch):
        msg = decode(as_bytes(b.to_frames("s", 0, 1)), receiver.limits)
        slot = free.pop()  # the receiver takes each slot back once its copy is done
        slot.fill(batch_from_message(msg, 600, seq_len, rows), 0, 1, "s", 0.0)
        return feed.to_device(slot)

    try:
        yield inputs
    finally:
        receiver.stop()


def test_masked_tokens_get_exactly_zero_gradient():
    """Token 96 is only ever a masked target: the logits that predict it get exactly zero gradient,
    as does every masked position, while the trained ones do not; and changing the masked tail of a
    document changes neither the loss nor any gradient."""
    prompt, completion = [96, 96, 5, 6, 96, 7], [20, 21, 22, 23]
    docs = [prompt + completion + [96, 96], [30, 31, 32, 33, 34, 35]]
    masks = [[0] * len(prompt) + [1] * len(completion) + [0, 0], None]
    (b,) = list(
        batches(MaskedStream(docs, masks), BatchSpec(strategy="pack", seq_len=12, batch_size=2), epochs=1)
    )
    with trainer_feed(2, 12, "pack") as inputs:
        inp = inputs(b)
    trained = inp.targets != IGNORE
    assert not (inp.targets == 96).any(), "a masked token is never a target"
    assert int(trained.sum()) == b.num_targets() == len(completion) + 5  # row 1: doc 1, 6 tokens

    def run(inp):
        model = tiny_model(seed=1).train()
        logits = {}

        def keep(module, args, out):  # the logits, kept for their gradient
            out.retain_grad()
            logits["t"] = out

        model.lm_head.register_forward_hook(keep)
        _, loss = model(inp.idx, inp.pos, inp.attn, inp.targets)
        loss.backward()
        return loss, logits["t"].grad, [p.grad.clone() for p in model.parameters()]

    loss, g, grads = run(inp)
    assert (g[~trained] == 0).all(), "masked and cross-document positions: exactly zero gradient"
    assert (g[trained].abs().sum(-1) > 0).all(), "every trained position has a gradient"

    tail = [i for i, m in enumerate(b.loss_mask[0]) if m == 0 and i >= len(prompt)]
    other = copy.deepcopy(inp)
    assert tail == [10, 11] and (inp.targets[0, 9:] == IGNORE).all()
    other.idx[0, tail] = 3  # the masked tail: only positions whose targets are masked see it
    loss2, g2, grads2 = run(other)
    assert torch.equal(loss, loss2)
    for a, c in zip(grads, grads2):
        assert torch.equal(a, c)


@pytest.mark.cuda
def test_the_cuda_feed_carries_the_mask():
    """Pinned slot, copy stream and events: the same targets on the GPU as on the CPU."""
    docs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20]]
    masks = [[0, 0, 0, 1, 1, 1, 0], None, [1, 0, 1, 0, 1, 0]]
    for strategy in ("pack", "pad-batch"):
        (b,) = list(batches(MaskedStream(docs, masks), BatchSpec(strategy=strategy, seq_len=8, batch_size=3),
                            epochs=1))  # fmt: skip
        with trainer_feed(3, 8, strategy) as cpu, trainer_feed(3, 8, strategy, "cuda") as gpu:
            want, got = cpu(b), gpu(b)
            torch.cuda.synchronize()
        assert got.targets.is_cuda and torch.equal(got.targets.cpu(), want.targets)
        assert int((want.targets != IGNORE).sum()) == b.num_targets()


@pytest.mark.parametrize("strategy", ["pad-batch", "bucket", "pack"])
def test_accumulation_with_masks_equals_one_big_batch(strategy):
    """Two micro-batches of B rows, normalised by the step's trained targets, give the update of one
    batch of 2B rows: the loss is a sum over trained targets, not a mean of per-batch means."""
    rng = random.Random(4)
    docs = [[rng.randint(1, 96) for _ in range(rng.randint(3, 30))] for _ in range(20)]
    masks = [None if i % 3 == 0 else [int(rng.random() < 0.4) for _ in d] for i, d in enumerate(docs)]
    B, T = 2, 32
    micro = list(batches(MaskedStream(docs, masks), BatchSpec(strategy=strategy, seq_len=T, batch_size=B,
                                                              bucket_k=31), epochs=1))[:2]  # fmt: skip
    assert len(micro) == 2 and all(m.rows == B for m in micro)
    assert len({m.num_targets() for m in micro}) == 2, "unequal target counts: a mean of means would differ"
    big = Batch(
        tokens=np.concatenate([_widen(m.tokens, T) for m in micro]),
        lengths=np.concatenate([m.lengths for m in micro]),
        doc_id=np.concatenate([m.doc_id for m in micro]),
        doc_start=np.concatenate([m.doc_start for m in micro]),
        doc_len=np.concatenate([m.doc_len for m in micro]),
        strategy=strategy,
        cursor=micro[-1].cursor,
        seg=None if micro[0].seg is None else np.concatenate([m.seg for m in micro]),
        loss_mask=np.concatenate([_widen(_mask_of(m), T) for m in micro]),
    )
    n_targets = sum(m.num_targets() for m in micro)
    assert big.num_targets() == n_targets
    base = tiny_model(seed=3)
    results = []
    with trainer_feed(B, T, strategy) as small, trainer_feed(2 * B, T, strategy) as large:
        accumulated, one = [small(m) for m in micro], [large(big)]
    for inputs in (accumulated, one):
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient itself
        loss, norm = StepRunner(model, opt, TrainConfig(grad_clip=1.0, fused_adamw=False), None).step(
            inputs, n_targets, lr=1.0
        )
        results.append((loss, norm, [p.detach().clone() for p in model.parameters()]))
    (la, na, pa), (lb, nb, pb) = results
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(na, nb, rtol=1e-5, atol=1e-6)
    for a, c in zip(pa, pb):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((a.shape[0], width), dtype=a.dtype)
    out[:, : a.shape[1]] = a
    return out


def _mask_of(b: Batch) -> np.ndarray:
    return (
        b.loss_mask
        if b.loss_mask is not None
        else (np.arange(b.width)[None] < b.lengths[:, None]).astype(np.uint8)
    )


def test_plain_shards_stay_version_1_without_mask_files(tmp_path, tok):
    from lmpipe.cli import main

    data = tmp_path / "plain.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document number {i}"}) for i in range(20)) + "\n")
    assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "s")]) == 0
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["format_version"] == 1 and "mask" not in meta["shards"][0]["files"]
    assert ShardSet(tmp_path / "s").mask(0) is None


def test_a_tokenizer_trained_on_a_finetuning_corpus_learns_its_prompts_too(tmp_path):
    from lmpipe.cli import main
    from lmpipe.shared.tokenizer import load_tokenizer

    data = tmp_path / "ft.jsonl"
    lines = [{"prompt": f"quizzicality {i} quizzicality", "completion": f" yes {i}"} for i in range(300)]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "t.json"),
                "--vocab-size",
                "400",
            ]
        )
        == 0
    )
    tok = load_tokenizer(tmp_path / "t.json")
    assert len(tok.tokenizer.encode("quizzicality", add_special_tokens=False).ids) == 1


def test_keys_of_another_kind_of_record_are_said_unread_once_per_file(tmp_path, caplog):
    """A record or table holding the keys of two kinds of record (text and ids, prompt/completion and text,
    a loss_mask and text) trains one kind; the keys left unread are said once per file (every epoch reopens
    it), with how to train the other kind instead where there is one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {
        "ids.jsonl": '{"text": "one two", "ids": [1, 2]}\n{"text": "three", "ids": [3]}\n',
        "input_ids.jsonl": '{"text": "four", "input_ids": [4]}\n',
        "pc.jsonl": '{"prompt": "q", "completion": "a", "text": "t"}\n',
        "mask.jsonl": '{"ids": [5, 6], "loss_mask": [0, 1], "text": "u"}\n',
        "bad_ids.jsonl": '{"text": "v", "ids": "abc"}\n',
        "plain.jsonl": '{"text": "w", "ids": null, "meta": {"url": "x"}}\n',
    }
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a b"], "input_ids": [[1, 2]], "prompt": ["q"]}), table)
    paths = [str(tmp_path / n) for n in files] + [str(table)]
    with caplog.at_level("WARNING", logger="lmpipe.producer"):
        for _ in range(2):
            got = [
                (r.text, r.prompt, None if r.ids is None else list(r.ids)) for r in Corpus(paths).records()
            ]
            assert got == [("one two", None, None), ("three", None, None), ("four", None, None), ("a", "q", None),
                           (None, None, [5, 6]), ("v", None, None), ("w", None, None), ("a b", None, None)]  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f'{tmp_path}/ids.jsonl:1: "ids" not read: a record with "text" trains its text (drop "text" to train '
        '"ids" as they are) (said once per file)',
        f'{tmp_path}/input_ids.jsonl:1: "input_ids" not read: a record with "text" trains its text; token ids '
        'go in "ids" in JSON Lines (said once per file)',
        f'{tmp_path}/pc.jsonl:1: "text" not read: a prompt/completion record trains its completion (said once '
        "per file)",
        f'{tmp_path}/mask.jsonl:1: "text" not read: a record with a loss_mask trains the ids it marks (said '
        "once per file)",
        f'{tmp_path}/bad_ids.jsonl:1: "ids" not read: a record with "text" trains its text (said once per file)',
        f"{table}: column 'text' is tokenized; 'input_ids', 'prompt' not read (--text-column input_ids trains "
        "the ids as they are)",
    ]
    ids = [r.ids.tolist() for r in Corpus([str(table)], text_column="input_ids").records()]
    assert ids == [[1, 2]]
