"""`lmpipe run --model DIR`: a tiny Llama from a local config.json trains on the built-in corpus, checkpoints,
resumes with every document trained exactly once, refuses another architecture's checkpoint in one line, and
exports weights that transformers loads (real processes, CPU)."""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch

from lmpipe.consumer.checkpoint import CheckpointManager
from tests.helpers import assert_exactly_once, builtin_lengths, doc_log_entries, run_lmpipe, small_run

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
DOCS = 40


def test_a_hugging_face_model_trains_resumes_exactly_once_and_exports(tmp_path, port, tok):
    folder = tmp_path / "llama"
    transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             bos_token_id=1, eos_token_id=2).save_pretrained(folder)  # fmt: skip
    ck, log = tmp_path / "ck", tmp_path / "docs.jsonl"
    common = ["run", "--model", str(folder), *small_run(port, builtin_docs=DOCS, seq_len=64, batch_size=4,
              producers=1, epochs=1, checkpoint_dir=ck, doc_log=log, log_every=2)]  # fmt: skip
    rc, out = run_lmpipe(tmp_path, "first", *common, "--steps", "3")
    assert rc == 0, out
    assert "packed rows: Llama (sdpa) isolates documents by position_ids" in out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+) -> ([0-9.]+)", out)[-1]]
    assert all(math.isfinite(x) for x in losses), out
    assert CheckpointManager(ck).latest_step() == 3

    rc, out = run_lmpipe(tmp_path, "resumed", *common, "--steps", "0", "--resume", "auto")
    assert rc == 0, out
    assert "resumed from " in out and ": step 3," in out
    entries = doc_log_entries(log)
    assert len(entries) > 3  # the resumed run trained on to the end of the data
    pieces: dict[int, list[tuple[int, int]]] = {}
    for e in entries:
        for b in e["batches"]:
            for did, start, n in b["docs"]:
                pieces.setdefault(did, []).append((start, n))
    assert_exactly_once(pieces, builtin_lengths(tok, DOCS))

    # lmpipe's own GPT does not resume a Llama's checkpoint: one line naming what differs
    rc, out = run_lmpipe(tmp_path, "other", *[("tiny" if a == str(folder) else a) for a in common],
                         "--resume", "auto")  # fmt: skip
    assert rc != 0 and "Traceback" not in out
    assert (
        "does not match this run: model: checkpoint has a Hugging Face 'llama' model, this run has lmpipe's GPT"
        in out
    ), out

    # the export is the model's own weights under its own names: transformers loads it beside config.json
    exported = tmp_path / "exported"
    exported.mkdir()
    rc, out = run_lmpipe(tmp_path, "export", "export", str(ck), "--out", str(exported / "model.safetensors"))
    assert rc == 0, out
    shutil.copy(folder / "config.json", exported)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    state = torch.load(CheckpointManager(ck).latest() / "state.pt", weights_only=True)["model"]
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, state["model." + name]), name
