"""The loader's state saved inside your own checkpoint, and resumed: run it twice, the second run goes on
from the first's last checkpoint (model, optimizer and the loader's cursors), every document exactly once.

    python examples/resume.py --steps 6 --ckpt /tmp/ckpt.pt
    python examples/resume.py --steps 12 --ckpt /tmp/ckpt.pt    # resumed at step 6
"""

import argparse
import os

import torch
import torch.nn.functional as F

from lmpipe import Loader

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--save-every", type=int, default=3)
ap.add_argument("--ckpt", default="ckpt.pt")
ap.add_argument("--device", default="cpu")
ap.add_argument("--port", type=int, default=5559)
args = ap.parse_args()

loader = Loader(seq_len=64, batch_size=8, producers=2, device=args.device, port=args.port)
model = torch.nn.Sequential(torch.nn.Embedding(loader.vocab_size, 64), torch.nn.Linear(64, loader.vocab_size))
model.to(args.device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
step = 0
if os.path.exists(args.ckpt):
    ckpt = torch.load(args.ckpt, weights_only=True)  # the loader's state is plain data
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    loader.load_state_dict(ckpt["loader"])  # before iterating: producers start at its cursors
    step = ckpt["step"]
    print(f"resumed at step {step}")


def save() -> None:  # written whole, then renamed: a crash never leaves half a checkpoint
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "loader": loader.state_dict(),
        "step": step,
    }
    torch.save(state, args.ckpt + ".tmp")
    os.replace(args.ckpt + ".tmp", args.ckpt)
    print(f"saved at step {step}")


with loader:
    for batch in loader:
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1  # the loader's state now covers this batch
        if step % args.save_every == 0:
            save()
        if step >= args.steps:
            break
print(f"done at step {step}")
