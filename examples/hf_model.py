"""A Hugging Face `transformers` model trained through lmpipe's Loader: a tiny Llama built from a local
config (nothing is downloaded). Packed rows keep their documents apart through `position_ids`, which
transformers turns into document-masked attention when `use_cache=False`.

    python examples/hf_model.py --steps 10 --device cpu
    python examples/hf_model.py --steps 200 --device cuda --hidden 768 --layers 12 --heads 12 --seq-len 1024

`train(model, loader, steps)` is reusable: any causal LM that takes input_ids, position_ids and labels.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmpipe import Loader


def train(model: torch.nn.Module, loader: Loader, steps: int, lr: float = 1e-3) -> dict[str, float]:
    """`steps` optimizer steps on the loader's batches: tokens/s, seconds waited for data, time to the first
    batch, and the first and last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    waited, first_batch, tokens, losses = 0.0, 0.0, 0, []
    it = iter(loader)
    for step in range(steps):
        w0 = time.perf_counter()
        batch = next(it, None)
        if batch is None:  # the loader's epochs are done
            break
        waited += time.perf_counter() - w0
        first_batch = first_batch or time.perf_counter() - t0
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=batch["labels"],
            use_cache=False,
        )
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += batch["input_ids"].numel()
        if step == 0 or step == steps - 1:
            losses.append(out.loss.item())  # a host sync: only at the ends
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "data_wait_s": waited, "first_batch_s": first_batch,
            "first_loss": losses[0], "last_loss": losses[-1]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=5557)
    ap.add_argument("--data", nargs="*", default=[])
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    settings = dict(
        data=args.data, seq_len=args.seq_len, batch_size=args.batch_size, producers=args.producers
    )
    with Loader(device=args.device, port=args.port, **settings) as loader:
        config = LlamaConfig(
            vocab_size=loader.vocab_size, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
            max_position_embeddings=args.seq_len,
        )  # fmt: skip
        model = LlamaForCausalLM(config).to(args.device)
        stats = train(model, loader, args.steps)
    print(f"loss {stats['first_loss']:.3f} -> {stats['last_loss']:.3f}; {stats['tokens_per_s']:,.0f} tokens/s; "
          f"data wait {stats['data_wait_s']:.2f} s; first batch after {stats['first_batch_s']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
