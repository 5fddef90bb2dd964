"""The library's batch dict (consumer/batchdict.py): labels are the trainer's targets in Hugging Face's
convention, positions and document offsets match the documents, and a transformers model given the
position_ids (use_cache=False) keeps packed documents apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmpipe.consumer.batchdict import batch_dict, cu_seqlens_exact, dense_mask
from lmpipe.consumer.inputs import build_inputs, targets_for

IGNORE = -100


def packed(loss_mask: bool = False):
    # row 0: documents 0 (5 tokens), 1 (3 tokens); row 1: document 2 (6 tokens) then 2 pads
    tokens = torch.tensor([[11, 12, 13, 14, 15, 21, 22, 23], [31, 32, 33, 34, 35, 36, 0, 0]])
    lengths = torch.tensor([8, 6], dtype=torch.int32)
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.uint8) if loss_mask else None
    cu = torch.from_numpy(cu_seqlens_exact(seg.numpy()))
    return tokens, lengths, seg, mask, cu


def test_labels_are_the_trainers_targets_shifted_right_with_every_ignored_position():
    tokens, lengths, seg, mask, cu = packed(loss_mask=True)
    b = batch_dict(tokens, lengths, seg, mask, cu, 8)
    targets = targets_for(tokens.long(), lengths, seg, mask)
    assert torch.equal(b["labels"][:, 1:], targets[:, :-1]) and (b["labels"][:, 0] == IGNORE).all()
    expected = torch.tensor(
        [
            # the prompt (mask 0) and each document's first token are ignored; the rest are the tokens
            [IGNORE, IGNORE, 13, 14, 15, IGNORE, 22, 23],
            [IGNORE, 32, 33, 34, 35, 36, IGNORE, IGNORE],  # pads ignored
        ]
    )
    assert torch.equal(b["labels"], expected)
    assert b["input_ids"].dtype == torch.int64 and b["labels"].dtype == torch.int64


def test_positions_restart_at_each_document_and_offsets_name_every_piece():
    tokens, lengths, seg, _, cu = packed()
    b = batch_dict(tokens, lengths, seg, None, cu, int(np.diff(cu.numpy()).max()))
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], list(range(8))]
    assert b["document_ids"].dtype == torch.int32 and torch.equal(b["document_ids"], seg)
    assert b["cu_seqlens"].tolist() == [0, 5, 8, 16] and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"] == 8


def test_pad_batches_have_one_document_per_row():
    tokens, lengths, _, _, _ = packed()
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    b = batch_dict(tokens, lengths, None, None, cu, 8)
    assert (b["document_ids"] == 0).all() and b["position_ids"].tolist() == [list(range(8))] * 2
    assert b["labels"][1].tolist() == [IGNORE, 32, 33, 34, 35, 36, IGNORE, IGNORE]


def test_the_dense_mask_is_the_trainers_document_causal_mask():
    tokens, lengths, seg, _, cu = packed()
    b = batch_dict(tokens, lengths, seg, None, cu, 8)
    ref = build_inputs(tokens, lengths, seg, attention="dense").attn.mask
    assert torch.equal(dense_mask(b), ref)


def test_a_transformers_model_given_position_ids_keeps_packed_documents_apart():
    """transformers detects packed rows from position_ids only with use_cache=False (examples/hf_model.py
    passes it): the logits of a document do not change when the document before it in the row changes."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    first, other, second = (torch.randint(1, 97, (n,), generator=g) for n in (10, 10, 6))
    logits = []
    for before in (first, other):
        tokens = torch.cat([before, second])[None]
        seg = torch.tensor([[0] * 10 + [1] * 6], dtype=torch.int32)
        cu = torch.from_numpy(cu_seqlens_exact(seg.numpy()))
        b = batch_dict(tokens, torch.tensor([16], dtype=torch.int32), seg, None, cu, 10)
        with torch.no_grad():
            out = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False)
        logits.append(out.logits[0, 10:])
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
