"""A Hugging Face causal LM in lmpipe's trainer (--model DIR, consumer/hf.py): the adapter's loss, packed rows
that do not attend across documents, the packing probe's choice, fine-tuning weights, and one-line refusals.
Tiny configs built here; nothing is downloaded."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmpipe.consumer import hf
from lmpipe.consumer.build import build
from lmpipe.consumer.config import TrainConfig
from lmpipe.consumer.distributed import Dist
from lmpipe.consumer.hf_folder import folder_problem
from lmpipe.consumer.inputs import build_inputs
from lmpipe.shared.config import PipelineConfig

transformers = pytest.importorskip("transformers")

VOCAB = 97
CPU = torch.device("cpu")


def llama_dir(tmp: Path, **over) -> str:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, **over)  # fmt: skip
    cfg.save_pretrained(tmp / "llama")
    return str(tmp / "llama")


def qwen2_dir(tmp: Path) -> str:
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    cfg.save_pretrained(tmp / "qwen2")
    return str(tmp / "qwen2")


def gpt2_dir(tmp: Path) -> str:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=1, eos_token_id=2)  # fmt: skip
    cfg.save_pretrained(tmp / "gpt2")
    return str(tmp / "gpt2")


def model(folder: str, strategy: str = "pack", attention: str = "sdpa", seq_len: int = 16) -> hf.HFCausalLM:
    torch.manual_seed(0)
    return hf.build_model(folder, attention=attention, grad_checkpointing=False, tokenizer_vocab=VOCAB,
                          seq_len=seq_len, strategy=strategy, device=CPU, autocast_dtype=None)  # fmt: skip


def packed(first: list[int], second: list[int]):
    """One packed row: two documents."""
    tokens = torch.tensor([first + second])
    seg = torch.tensor([[0] * len(first) + [1] * len(second)], dtype=torch.int32)
    return build_inputs(tokens, torch.tensor([tokens.size(1)]), seg, attention="dense")


def test_loss_is_the_sum_of_cross_entropy_over_each_documents_next_tokens(tmp_path):
    m = model(llama_dir(tmp_path)).eval()
    a, b = [5, 9, 11, 3, 7], [40, 41, 42, 43, 44, 45, 46]
    inp = packed(a, b)
    _, loss = m(inp.idx, inp.pos, inp.attn, inp.targets)
    # by hand: each document alone through the transformers model, its logits against its next tokens
    want = torch.zeros(())
    for doc in (a, b):
        logits = m.model(input_ids=torch.tensor([doc]), use_cache=False).logits[0]
        want += F.cross_entropy(logits[:-1], torch.tensor(doc[1:]), reduction="sum")
    assert loss is not None and torch.allclose(loss, want, rtol=1e-5), (loss, want)


def second_document_logits(m: hf.HFCausalLM, first: list[int]) -> torch.Tensor:
    inp = packed(first, [30, 31, 32, 33, 34, 35])
    logits, _ = m.eval()(inp.idx, inp.pos, inp.attn)
    assert logits is not None
    return logits[0, len(first) :]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2-mask"])
def test_a_document_does_not_see_the_one_before_it_in_the_row(tmp_path, arch):
    m = model({"llama": llama_dir, "qwen2": qwen2_dir, "gpt2-mask": gpt2_dir}[arch](tmp_path))
    if arch == "gpt2-mask":
        m.packing = hf.MASK  # GPT-2 through the 4D document mask, whatever the probe chose
    same = second_document_logits(m, [3, 4, 5, 6, 7])
    changed = second_document_logits(m, [60, 61, 62, 63, 64])
    assert torch.allclose(same, changed, atol=1e-6)
    m.packing = hf.NONE  # the check is not vacuous: the same row unmasked leaks
    inp = packed([3, 4, 5, 6, 7], [30, 31, 32, 33, 34, 35])
    leaky = m.model(input_ids=inp.idx, use_cache=False).logits[0, 5:]
    assert not torch.allclose(leaky, same, atol=1e-3)


def test_the_probe_picks_position_ids_then_the_mask_then_refuses(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "lmpipe.trainer")
    assert model(llama_dir(tmp_path)).packing == hf.POSITION_IDS
    assert "packed rows: Llama (sdpa) isolates documents by position_ids" in caplog.text
    # transformers that does not read packed sequences from position ids (as GPT-2 in some versions)
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda pos: None)
    assert model(gpt2_dir(tmp_path)).packing == hf.MASK
    assert "packed rows: GPT2 (sdpa) isolates documents by a 4D document mask" in caplog.text
    with pytest.raises(
        ValueError, match=r"^--strategy pack: GPT2 \(eager\) lets packed documents attend"
    ) as e:
        model(gpt2_dir(tmp_path), attention="eager")
    assert "\n" not in str(e.value)
    assert model(gpt2_dir(tmp_path), strategy="pad", attention="eager").packing == hf.NONE


def test_weights_in_the_folder_are_loaded(tmp_path):
    folder = llama_dir(tmp_path)
    torch.manual_seed(5)
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    saved.save_pretrained(folder)
    m = model(folder)
    assert m.weights == "its weights"
    for (name, p), q in zip(saved.state_dict().items(), m.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_without_transformers_one_line(tmp_path, monkeypatch):
    folder = llama_dir(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'lmpipe\[hf\]'$"):
        model(folder)


def test_vocab_seq_len_and_remote_code_refused_in_one_line(tmp_path):
    small = llama_dir(tmp_path)
    with pytest.raises(ValueError, match="its vocab_size 97 is smaller than the tokenizer's 500"):
        hf.build_model(small, attention="sdpa", grad_checkpointing=False, tokenizer_vocab=500, seq_len=16,
                       strategy="pack", device=CPU, autocast_dtype=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"^--seq-len 128 is above --model .*'s 64 positions"):
        model(small, seq_len=128)
    # the launcher's checks say the same without torch
    assert "vocab_size 97 is smaller" in str(folder_problem(small, 500, 16))
    assert "--seq-len 128 is above" in str(folder_problem(small, VOCAB, 128))
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "x.Y"}, "model_type": "mine"}))
    with pytest.raises(ValueError, match="trust_remote_code"):
        model(str(remote))


def test_build_says_no_fast_path_applies_and_refuses_a_named_one(tmp_path):
    folder = llama_dir(tmp_path)
    pcfg = PipelineConfig(seq_len=16)
    built = build(pcfg, TrainConfig(model=folder), VOCAB, CPU, "fp32", None, Dist())
    assert built.fast == [] and "not for a Hugging Face model" in built.fast_line
    assert built.model.num_params() > 0 and built.model.flops_per_token(16) > 6 * built.model.num_params()
    with pytest.raises(ValueError, match="^--fast clip-in-step: not for a Hugging Face model"):
        build(pcfg, TrainConfig(model=folder, fast="clip-in-step"), VOCAB, CPU, "fp32", None, Dist())


def test_compiled_adapter_gives_the_eager_loss(tmp_path):
    # traced, transformers builds the packed mask from position ids on another branch (masking_utils
    # find_packed_sequence_indices); aot_eager traces as inductor would, without its compile time
    m = model(llama_dir(tmp_path)).eval()
    inp = packed([5, 9, 11, 3, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47])
    _, eager = m(inp.idx, inp.pos, inp.attn, inp.targets)
    _, compiled = torch.compile(m, dynamic=False, backend="aot_eager")(
        inp.idx, inp.pos, inp.attn, inp.targets
    )
    assert torch.allclose(eager, compiled, rtol=1e-4)


@pytest.mark.cuda
def test_on_a_gpu_a_compiled_bf16_step_keeps_packed_documents_apart(tmp_path):
    """The installed transformers on CUDA, in bf16 and compiled: the probe's choice, the leak check, a step."""
    cuda = torch.device("cuda")
    folder = llama_dir(tmp_path)
    pcfg = PipelineConfig(seq_len=16, batch_size=1)
    tcfg = TrainConfig(model=folder, device="cuda", compile=True)
    built = build(pcfg, tcfg, VOCAB, cuda, "bf16", torch.bfloat16, Dist())
    m = built.model
    assert isinstance(m, hf.HFCausalLM) and m.packing in (hf.POSITION_IDS, hf.MASK)
    seg = torch.tensor([[0] * 8 + [1] * 8], dtype=torch.int32, device=cuda)

    def second(first: list[int]) -> torch.Tensor:
        tokens = torch.tensor([first + list(range(30, 38))], device=cuda)
        inp = build_inputs(tokens, torch.tensor([16], device=cuda), seg)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = built.step_model.eval()(inp.idx, inp.pos, inp.attn)
        return logits[0, 8:].float()

    assert torch.allclose(second(list(range(3, 11))), second(list(range(60, 68))), atol=1e-3)
    tokens = torch.randint(0, VOCAB, (1, 16), device=cuda)
    inp = build_inputs(tokens, torch.tensor([16], device=cuda), seg)
    loss, _ = built.runner.step([inp], 14.0, 1e-3)
    assert torch.isfinite(loss)
