"""A Hugging Face `transformers` GPT-2 124M trained in a user's own loop, fed by lmpipe's Python API
(`lmpipe.Loader`) against the same model fed by a `torch.utils.data.DataLoader` with as many workers, side by
side in one run on one card.

    python -m bench.hf_feed                       # 4 producers / workers, WikiText-2 raw text
    python -m bench.hf_feed --workers 2 --seconds 30

Both feeds read the same raw text with the same tokenizer and pack it into the same [B, L] rows (lmpipe's
packing, run inside each DataLoader worker: bench/peers.py's PackedText), pinned on the host and copied to
the GPU without blocking; both turn a batch into `input_ids`, `labels` and `position_ids` with the same
functions (lmpipe/consumer/batchdict.py). The loop is what a user writes: `model(**batch).loss`, backward,
fused AdamW, bf16 autocast, torch.compile, the loss read every 10 steps. GPT-2's attention in `transformers`
does not isolate packed documents from position_ids alone; that costs both feeds alike (a feed benchmark).

Figures per feed, each in a fresh process, in a training script's order (loader, model, loop): steady tokens/s
over a window after a warm-up, the share of that window spent waiting for the next batch, the time from the
loop's first iter() to the first batch in hand, and the loader's constructor (timed apart: the Loader's starts
its producers' zygote, whose warm-up then overlaps the model's construction; the DataLoader's does nothing,
its workers fork at iter()). bench/first_batch.py times construction to first batch with nothing between.
Writes bench/results/hf-feed-<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import WIKITEXT, smoke_out, table, write_result
from bench.trainbench import bench_data

FEEDS = ("lmpipe", "dataloader")
# what is measured: (row, feed, lmpipe's --shards; 0: the workers' count). lmpipe splits the corpus into 16
# shards by default (producers may join and leave); one shard per producer splits it as a DataLoader splits
# it among its workers.
RUNS = (("lmpipe, 16 shards (default)", "lmpipe", 16), ("lmpipe, a shard per producer", "lmpipe", 0),
        ("DataLoader", "dataloader", 0))  # fmt: skip
FIRST_REPS, IDLE = 3, 1.0  # first_batches(): runs a feed; seconds between constructor and loop


def gpt2(vocab: int, seq_len: int, smoke: bool, device: torch.device):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_embd=64, n_layer=2, n_head=4) if smoke else {}  # GPT-2 124M: the config's defaults
    cfg = GPT2Config(vocab_size=(vocab + 63) // 64 * 64, n_positions=seq_len, **size)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).to(device)


def lmpipe_loader(a, device: torch.device):
    """lmpipe's Loader; constructing it starts its producers' zygote (lmpipe/zygote.py), nothing else."""
    from lmpipe import Loader

    return Loader(data=a.text, tokenizer=a.tok, seq_len=a.seq_len, batch_size=a.batch_size,
                  producers=a.workers, shards=a.shards, shuffle_window=1000, device=str(device),
                  metrics_port=-1)  # fmt: skip


def lmpipe_batches(loader):
    with loader:
        for batch in loader:
            yield {k: batch[k] for k in ("input_ids", "labels", "position_ids")}


def dataloader(a, device: torch.device):
    """A DataLoader with as many workers (they fork at its first iter())."""
    from torch.utils.data import DataLoader

    from bench.peers import PackedText

    ds = PackedText(a.text, a.tok, a.seq_len, a.batch_size, epochs=0)
    return DataLoader(ds, batch_size=None, num_workers=a.workers, pin_memory=device.type == "cuda")


def dataloader_batches(dl, device: torch.device):
    from lmpipe.consumer.batchdict import batch_dict, cu_seqlens_exact

    for b in dl:
        # the whole batch dict, as the Loader builds it: its document offsets from the host copy of seg
        cu = torch.from_numpy(cu_seqlens_exact(b["seg"].numpy()))
        max_seqlen = int((cu[1:] - cu[:-1]).max())
        tokens, lengths, seg, cu = (
            t.to(device, non_blocking=True) for t in (b["tokens"], b["lengths"], b["seg"], cu)
        )
        batch = batch_dict(tokens, lengths, seg, None, cu, max_seqlen)
        yield {k: batch[k] for k in ("input_ids", "labels", "position_ids")}


def child(a) -> dict:
    """One feed's measurement, in a training script's order: the loader constructed (timed), the model
    built (not timed), then the loop, whose clock starts at its first iter()."""
    device = torch.device(a.device)
    from lmpipe.shared.tokenizer import load_tokenizer

    vocab = load_tokenizer(a.tok).vocab_size  # imported and loaded with the model's code, before any clock
    tc = time.perf_counter()
    loader = lmpipe_loader(a, device) if a.feed == "lmpipe" else dataloader(a, device)
    constructor = time.perf_counter() - tc
    model = gpt2(vocab, a.seq_len, a.smoke, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if a.compile else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    t0 = time.perf_counter()
    it = iter(lmpipe_batches(loader) if a.feed == "lmpipe" else dataloader_batches(loader, device))
    first = warm = start = None
    steps = waited = 0.0
    while True:
        tw = time.perf_counter()
        batch = next(it)
        now = time.perf_counter()
        with amp:
            loss = step_model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first is None:
            first, warm = now - t0, now
            loss.item()  # compiled: the first step's compile ends here
        elif start is None:
            if time.perf_counter() - warm >= a.warmup:
                loss.item()
                start, steps, waited = time.perf_counter(), 0, 0.0
        else:
            steps += 1
            waited += now - tw
            if steps % 10 == 0:
                last = loss.item()  # a user's loop reads its loss now and then
                if time.perf_counter() - start >= a.seconds:
                    elapsed = time.perf_counter() - start
                    it.close()  # the loader's context exits: its producers stop
                    return {"tokens_per_second": steps * a.batch_size * a.seq_len / elapsed,
                            "data_wait": waited / elapsed, "first_batch": first, "constructor": constructor,
                            "loss": last}  # fmt: skip


def first_batches(a, text: list[str]) -> str:
    """bench/first_batch.py's figures on this machine, medians of FIRST_REPS alternated runs: construction
    to the first batch with nothing between (the Loader's worst case), and with IDLE seconds between."""
    from bench import first_batch

    a.shards, a.idle = 16, IDLE
    lines = [f"Construction to the first batch without the model ({FIRST_REPS} runs a feed, medians; "
             "bench/first_batch.py):\n"]  # fmt: skip
    for idle in (0.0, IDLE):
        meds = {
            f: first_batch.medians(rs) for f, rs in first_batch.measure(a, text, idle, FIRST_REPS).items()
        }
        lm, dl = meds["lmpipe"], meds["dataloader"]
        between = "nothing between" if idle == 0 else f"{idle:g} s between constructor and loop"
        lines.append(f"- {between}: lmpipe {lm['first_batch']:.2f} s (constructor {lm['constructor']:.3f} s, "
                     f"loop {lm['loop']:.2f} s), DataLoader {dl['first_batch']:.2f} s (loop {dl['loop']:.2f} s)")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="lmpipe's producers and the DataLoader's workers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds after the first step before measuring")
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--smoke", action="store_true", help="a 2-layer model, short windows; writes outside bench/results"
    )
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=FEEDS, help=argparse.SUPPRESS)
    p.add_argument("--text", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    p.add_argument("--shards", type=int, default=16, help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, on both sides
    if a.child:
        a.feed = a.child
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    if a.smoke:
        a.seq_len, a.batch_size, a.warmup, a.seconds, a.compile = 128, 4, 1.0, 2.0, False
        a.out = smoke_out(a.out)
    a.tok, _ = bench_data(Path(a.work))
    text = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    results = {}
    for row, feed, shards in RUNS:
        cmd = [sys.executable, "-m", "bench.hf_feed", "--child", feed, "--text", *text, "--tok", a.tok,
               "--workers", str(a.workers), "--shards", str(shards or a.workers), "--device", a.device,
               "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--warmup", str(a.warmup),
               "--seconds", str(a.seconds), *([] if a.compile else ["--no-compile"]),
               *(["--smoke"] if a.smoke else [])]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            sys.exit(f"{row}: exit {out.returncode}\n{out.stderr[-3000:]}")
        results[row] = json.loads(lines[-1][7:])
        print(row, results[row], flush=True)
    ref = results["DataLoader"]
    rows = [[feed, r["tokens_per_second"], f"{r['tokens_per_second'] / ref['tokens_per_second']:.3f}x",
             f"{100 * r['data_wait']:.2f}%", f"{r['first_batch']:.2f} s", f"{r['constructor']:.3f} s",
             f"{r['loss']:.3f}"]
            for feed, r in results.items()]  # fmt: skip
    body = (
        f"{'a 2-layer GPT-2 (smoke)' if a.smoke else 'GPT-2 124M'} (`transformers` GPT2LMHeadModel, sdpa), bf16 autocast, fused AdamW, "
        f"{'torch.compile' if a.compile else 'eager'}; {a.batch_size} x {a.seq_len} tokens a step; "
        f"{a.workers} producers / DataLoader workers; WikiText-2 valid+test raw text; {a.warmup:g} s warm-up, "
        f"{a.seconds:g} s measured.\n\n"
        + table(
            ["feed", "tokens/s", "vs DataLoader", "data wait", "first batch", "constructor", "last loss"],
            rows,
        )
        + "\n\n"
        + first_batches(a, text)
    )
    print(body)
    write_result("hf-feed", "A transformers GPT-2 fed by lmpipe's API against a DataLoader", body, a.out)


if __name__ == "__main__":
    main()
