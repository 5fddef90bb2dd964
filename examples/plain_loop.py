"""A plain PyTorch training loop fed by lmpipe (built-in corpus and tokenizer; --data for your own files).

python examples/plain_loop.py --steps 20 --device cpu
"""

import argparse

import torch
import torch.nn.functional as F

from lmpipe import Loader

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--device", default="cpu")
ap.add_argument("--port", type=int, default=5555)
ap.add_argument("--data", nargs="*", default=[])
args = ap.parse_args()

with Loader(
    data=args.data, seq_len=64, batch_size=8, producers=2, device=args.device, port=args.port
) as loader:
    model = torch.nn.Sequential(  # a tiny next-token model; yours goes here
        torch.nn.Embedding(loader.vocab_size, 64), torch.nn.GELU(), torch.nn.Linear(64, loader.vocab_size)
    ).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in enumerate(loader):
        logits = model(batch["input_ids"])
        # labels are not shifted (Hugging Face's convention): position t predicts labels[t + 1]
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
        if step + 1 == args.steps:
            break
print(f"trained {step + 1} steps, final loss {loss.item():.3f}")
