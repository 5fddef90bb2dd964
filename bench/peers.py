"""lmpipe against the loaders a user would pick instead, side by side in one run: the same corpus, tokenizer,
packing and consumer.

    python -m bench.peers                            # 1 and 2 workers (as the cores allow), WikiText-2
    python -m bench.peers --workers 1,4,8 --loaders lmpipe,dataloader

Loaders (N = workers = producers, one core each, TOKENIZERS_PARALLELISM=false everywhere):
- lmpipe: N producer processes from raw text (forked, as `lmpipe run` starts them) into the trainer's
  consume-only loop (in process);
- lmpipe-shards: the same from shards written by `lmpipe prepare` (tokenized once);
- dataloader: torch.utils.data.DataLoader, N workers, an IterableDataset that runs lmpipe's own reading,
  tokenization and packing (DocStream + batches) in each worker, pinned memory on CUDA;
- torchdata: torchdata's StatefulDataLoader over the same dataset;
- streaming: MosaicML Streaming, StreamingDataset + StreamingDataLoader over MDS shards of the same
  packed rows (tokenized and packed once, as its LLM recipes do).
The consumer is the trainer's consume-only step for every loader: copy the batch to the device
(non_blocking from pinned memory on CUDA; a converting copy on CPU, as the trainer's feed does).

Figures: steady tokens/s over a window after a warm-up, the share of that time spent waiting for the
loader, time from start to the first batch delivered (worker or producer start-up included: for a PyTorch
loader when its iterator hands the batch over, for lmpipe when the trainer has received and validated it)
and, apart, to the first trained step done (with --model: the model's build and torch.compile are in it, for
every loader alike; lmpipe compiles while its producers deliver), peak host
memory (VmHWM summed over the loader's processes: shared pages count once per process, so forked workers
are over-counted a little), and after a kill -9 of the consumer mid-epoch and a resume from its last
checkpoint: documents lost or repeated over the epoch. Resume per loader: lmpipe its checkpoints
(producer cursors) and --resume; torchdata and streaming their loader's state_dict saved with each
checkpoint; a plain DataLoader has none, so it starts the epoch again (the usual fallback). Each
measurement runs in a fresh process. Writes bench/results/peers-<date>.md.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from bench.common import WIKITEXT, free_port_pair, stop, table, write_result
from bench.stages import peak_rss
from bench.trainbench import bench_data

LOADERS = ("lmpipe", "lmpipe-shards", "dataloader", "torchdata", "streaming")
PACKAGES = {"torchdata": "torchdata", "streaming": "streaming"}
# what a loader reads, and the lmpipe run it is compared with: raw text, or text tokenized (and packed) once
INPUT = {"lmpipe": "raw text", "dataloader": "raw text", "torchdata": "raw text",
         "lmpipe-shards": "tokenized", "streaming": "tokenized"}  # fmt: skip
REFERENCE = {"raw text": "lmpipe", "tokenized": "lmpipe-shards"}


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tree_peak_rss(pid: int) -> int:
    """VmHWM of a process and of its descendants, summed."""
    return peak_rss(pid) + sum(tree_peak_rss(c) for c in children(pid))


# -- the dataset the PyTorch loaders share: lmpipe's reading, tokenization and packing in each worker ------


class PackedText(IterableDataset):
    def __init__(self, files: list[str], tok: str, seq_len: int, batch_size: int, epochs: int):
        self.files, self.tok, self.seq_len, self.batch_size, self.epochs = (
            files,
            tok,
            seq_len,
            batch_size,
            epochs,
        )

    def __iter__(self):
        from lmpipe.producer.batching import BatchSpec, batches
        from lmpipe.producer.sources import Corpus
        from lmpipe.producer.stream import DocStream
        from lmpipe.shared.batch import token_dtype
        from lmpipe.shared.tokenizer import load_tokenizer

        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        tok = load_tokenizer(self.tok)
        stream = DocStream(Corpus(self.files), tok, worker=w, num_workers=n, shuffle_window=1000)
        spec = BatchSpec(strategy="pack", seq_len=self.seq_len, batch_size=self.batch_size)
        for b in batches(stream, spec, epochs=self.epochs, dtype=token_dtype(tok.vocab_size)):
            yield as_tensors(b.tokens, b.lengths, b.seg, np.stack([b.doc_id, b.doc_start, b.doc_len], 1))


def as_tensors(tokens, lengths, seg, docs) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
        "lengths": torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int32)),
        "seg": torch.from_numpy(np.ascontiguousarray(seg)),
        "docs": torch.from_numpy(np.ascontiguousarray(docs, dtype=np.int64)),
    }


def _stub_torchvision() -> None:
    """mosaicml-streaming imports torchvision for its vision datasets, unused here; where no torchvision
    matching this torch is installed (there is no CPU wheel of it for torch 2.13), stand-ins let it load."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        pass
    tv = types.ModuleType("torchvision")
    ds = types.ModuleType("torchvision.datasets")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    for m in (tv, ds, tr, fn):  # importlib.util.find_spec (transformers asks) wants a spec
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    ds.VisionDataset = ds.CIFAR10 = type("VisionDataset", (), {})  # type: ignore[attr-defined]
    fn.to_tensor = lambda x: x  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, tr.functional = ds, tr, fn  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": ds, "torchvision.transforms": tr,
                        "torchvision.transforms.functional": fn})  # fmt: skip


def write_mds(files: list[str], tok_path: str, seq_len: int, batch_size: int, out: Path) -> None:
    """The corpus tokenized and packed once by lmpipe's code, one MDS sample per packed row."""
    _stub_torchvision()
    from streaming import MDSWriter

    from lmpipe.producer.batching import BatchSpec, batches
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_path)
    spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=batch_size)
    cols = {"tokens": f"ndarray:uint16:{seq_len}", "seg": f"ndarray:uint16:{seq_len}", "docs": "ndarray:int64",
            "length": "int"}  # fmt: skip
    with MDSWriter(out=str(out), columns=cols, compression=None, progress_bar=False) as w:
        for b in batches(DocStream(Corpus(files), tok, shuffle_window=1000), spec, epochs=1):
            docs = np.stack([b.doc_id, b.doc_start, b.doc_len], 1).astype(np.int64)
            at = 0
            for r in range(b.rows):
                k = int(b.seg[r, b.lengths[r] - 1]) + 1 if b.lengths[r] else 0  # pieces restart per row
                w.write({"tokens": b.tokens[r].astype(np.uint16), "seg": b.seg[r].astype(np.uint16),
                         "docs": docs[at : at + k].reshape(-1), "length": int(b.lengths[r])})  # fmt: skip
                at += k


def _collate_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    return as_tensors(
        np.stack([r["tokens"] for r in rows]),
        np.array([r["length"] for r in rows]),
        np.stack([r["seg"] for r in rows]),
        np.concatenate([r["docs"] for r in rows]).reshape(-1, 3),
    )


def make_loader(name: str, workers: int, a, epochs: int):
    """A fresh loader; `epochs` 0: endless where the loader allows it (streaming: one epoch per pass)."""
    pin = a.device == "cuda"
    if name in ("dataloader", "torchdata"):
        ds = PackedText(a.text, a.tok, a.seq_len, a.batch_size, epochs)
        if name == "dataloader":
            from torch.utils.data import DataLoader as Loader
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader as Loader
        return Loader(ds, batch_size=None, num_workers=workers, pin_memory=pin)
    if name == "streaming":
        _stub_torchvision()
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()  # a killed run leaves its shared memory behind
        ds = StreamingDataset(local=a.mds, batch_size=a.batch_size, shuffle=False)
        return StreamingDataLoader(ds, batch_size=a.batch_size, num_workers=workers, collate_fn=_collate_rows,
                                   pin_memory=pin, persistent_workers=workers > 0 and epochs == 0)  # fmt: skip
    raise ValueError(name)


def consume(batch: dict[str, torch.Tensor], device: torch.device) -> int:
    """The trainer's consume-only step (consumer/feed.py DeviceFeed.copy); returns the real tokens."""
    if device.type == "cuda":
        for k in ("tokens", "lengths", "seg"):
            batch[k].to(device, non_blocking=True)
    else:
        batch["tokens"].to(torch.int64), batch["lengths"].clone(), batch["seg"].to(torch.int32)
    return int(batch["lengths"].sum())


class ModelStep:
    """The trainer's step on a peer's batches: lmpipe's Trainer, built but never started (no sockets), with
    its model, optimizer, input building and step, as bench/trainbench.py's synthetic run uses them."""

    def __init__(self, a):
        from lmpipe.consumer.trainer import Trainer
        from lmpipe.shared.config import PipelineConfig

        pcfg = PipelineConfig(tokenizer=a.tok, strategy="pack", seq_len=a.seq_len, batch_size=a.batch_size,
                              port=free_port_pair())  # fmt: skip
        self.trainer = Trainer(pcfg, model_config(a))
        self.steps = 0

    def __call__(self, batch: dict[str, torch.Tensor]) -> int:
        from lmpipe.consumer.inputs import build_inputs
        from lmpipe.consumer.step import lr_at

        tr, lengths, seg = self.trainer, batch["lengths"], batch["seg"].to(torch.int32)
        # the targets of the step, counted on the host from the batch as the receiver does from its header
        inside = torch.arange(seg.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
        n_targets = int(((seg[:, 1:] == seg[:, :-1]) & inside).sum())
        dev = tr.device
        tokens = batch["tokens"].to(dev, non_blocking=True)
        inp = build_inputs(tokens, lengths.to(dev, non_blocking=True), seg.to(dev, non_blocking=True),
                           attention=tr.cfg.attention, mask_cache=tr.mask_cache)  # fmt: skip
        loss, _ = tr.runner.step([inp], n_targets, lr_at(self.steps, tr.cfg))
        self.steps += 1
        if self.steps % tr.cfg.log_every == 0:
            float(loss)  # the trainer's one host sync per logging interval
        return int(lengths.sum())


def model_config(a, **over):
    from lmpipe.consumer.config import TrainConfig

    cuda = a.device.startswith("cuda")
    model = "tiny" if a.model == "none" else a.model  # none: --consume-only, which builds no model
    return TrainConfig(model=model, steps=0, device=a.device, compile=cuda and a.compile, lr=6e-4, warmup=10,
                       log_every=10, metrics_port=None, **over)  # fmt: skip


# -- children: one measurement in a fresh process ----------------------------------------------------------


def import_loader(name: str) -> None:
    """The loader's modules, imported before the clock starts: time to first batch is the loader's own."""
    if name.startswith("lmpipe"):
        import lmpipe.consumer.trainer  # noqa: F401
        import lmpipe.producer.manager  # noqa: F401  # what its forked producers run
    elif name == "torchdata":
        import torchdata.stateful_dataloader  # noqa: F401
    elif name == "streaming":
        _stub_torchvision()
        import streaming  # noqa: F401


def child_throughput(a) -> dict:
    device = torch.device(a.device)
    import_loader(a.loader)
    t0 = time.perf_counter()
    if a.loader.startswith("lmpipe"):
        return lmpipe_throughput(a, t0)
    step = ModelStep(a) if a.model != "none" else (lambda batch: consume(batch, device))
    dl = make_loader(a.loader, a.workers, a, epochs=0)
    first = start = None
    first_step = 0.0
    tokens = 0
    waited = 0.0
    while True:  # streaming: one pass per epoch; the others never end
        it = iter(dl)
        while True:
            tw = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            real = step(batch)
            if first is None:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the first step's real end (a compiled one: its compile)
                first, warm = now - t0, time.perf_counter()
                first_step = warm - t0
            elif start is None:
                if now - warm >= a.warmup:
                    start, tokens, waited = now, 0, 0.0
            else:
                tokens += real
                waited += now - tw
                if now - start >= a.seconds:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                    memory = tree_peak_rss(os.getpid())
                    del it
                    return {"tokens_per_second": tokens / elapsed, "data_wait": waited / elapsed,
                            "first_batch": first, "first_step": first_step, "memory": memory}  # fmt: skip


def lmpipe_throughput(a, t0: float) -> dict:
    from lmpipe.consumer.trainer import Trainer
    from lmpipe.launch import check_tokenizer, fork_producers
    from lmpipe.shared.config import PipelineConfig

    data = [a.shards] if a.loader == "lmpipe-shards" else a.text
    pcfg = PipelineConfig(data=data, tokenizer=a.tok, strategy="pack", seq_len=a.seq_len, batch_size=a.batch_size,
                          producers=a.workers, port=free_port_pair(), shuffle_window=1000)  # fmt: skip
    tcfg = model_config(a, consume_only=a.model == "none")
    # as `lmpipe run` does: the tokenizer loaded by its checks, producers forked before the trainer starts
    check_tokenizer(pcfg)
    procs = fork_producers(pcfg, -1, 0.0, "WARNING")
    trainer = Trainer(pcfg, tcfg)
    reg = trainer.metrics.registry
    marks: dict[str, tuple] = {}
    delivered = watch_first_batch(reg)

    def progress(step: int, stats: dict) -> None:
        now = time.perf_counter()
        at = (now, reg.get_sample_value("lmpipe_trainer_tokens_total"),
              reg.get_sample_value("lmpipe_trainer_data_wait_seconds_sum"))  # fmt: skip
        if "warm" not in marks:
            marks["warm"] = at
        elif "a" not in marks:
            if now - marks["warm"][0] >= a.warmup:
                marks["a"] = at
        elif now - marks["a"][0] >= a.seconds:
            marks["b"] = at
            marks["memory"] = (tree_peak_rss(os.getpid()),)  # the forked producers are in the tree
            trainer.request_stop("measured")

    try:
        summary = trainer.run(progress=progress)
    finally:
        stop(procs)
    (ta, ka, wa), (tb, kb, wb) = marks["a"], marks["b"]
    return {"tokens_per_second": (kb - ka) / (tb - ta), "data_wait": (wb - wa) / (tb - ta),
            "first_batch": (delivered[0] if delivered else float("nan")) - t0,
            "first_step": trainer._started + summary.time_to_first_step - t0, "memory": marks["memory"][0]}  # fmt: skip


def watch_first_batch(registry, every: float = 0.002) -> list[float]:
    """When the trainer first holds a received, validated batch (its received counter leaves 0), by a thread
    that polls the registry: a list that gets the time.perf_counter() of that moment. The step loop may take
    it later (after a compile): that is not the loader's time."""
    got: list[float] = []

    def received() -> float:
        return sum(s.value for m in registry.collect() if m.name == "lmpipe_trainer_batches_received"
                   for s in m.samples if s.name.endswith("_total"))  # fmt: skip

    def poll() -> None:
        deadline = time.monotonic() + 3600
        while not got and time.monotonic() < deadline:
            if received() > 0:
                got.append(time.perf_counter())
            time.sleep(every)

    threading.Thread(target=poll, name="first-batch", daemon=True).start()
    return got


def child_train(a) -> None:
    """One epoch, a doc log and a checkpoint every --checkpoint-every steps; resumes from that checkpoint."""
    device = torch.device(a.device)
    d = Path(a.dir)
    ck = d / "ck.pt"
    saved = torch.load(ck, weights_only=True) if ck.exists() else None
    dl = make_loader(a.loader, a.workers, a, epochs=1)
    stateful = a.loader != "dataloader"
    if saved is not None and stateful:
        dl.load_state_dict(saved["loader"])
    step = saved["step"] if saved else 0  # a plain DataLoader starts its epoch again
    session = uuid.uuid4().hex[:12]
    with open(d / "docs.jsonl", "a") as log:
        for batch in dl:
            consume(batch, device)
            row = {"step": step, "batches": [{"session": session, "docs": batch["docs"].tolist()}]}
            log.write(json.dumps(row) + "\n")
            log.flush()
            step += 1
            if step % a.checkpoint_every == 0:
                tmp = d / "ck.pt.tmp"
                torch.save({"step": step, "loader": dl.state_dict() if stateful else {}}, tmp)
                os.replace(tmp, ck)
    print("epoch done", flush=True)


# -- the parent: kill -9 mid-epoch, resume, count --------------------------------------------------------------


def doc_lengths(a) -> dict[int, int]:
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.tokenizer import load_tokenizer

    return {
        d.doc_id: len(d.ids)
        for d in DocStream(Corpus(a.text), load_tokenizer(a.tok), shuffle_window=0).docs(0)
    }


def lost_and_repeated(
    log: Path, first_session: str, resumed: int, lengths: dict[int, int]
) -> tuple[int, int]:
    """Documents with a token never trained, and with a token trained twice, over the epoch. The steps the
    killed consumer took after its last checkpoint died with it (their batches come again), as in
    tests/test_resume.py."""
    covered = {did: np.zeros(n, dtype=np.int32) for did, n in lengths.items()}
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line the kill tore
        if e["batches"][0]["session"] == first_session and e["step"] >= resumed:
            continue
        for b in e["batches"]:
            for did, start, n in b["docs"]:
                covered[did][start : start + n] += 1
    return sum(int((c == 0).any()) for c in covered.values()), sum(
        int((c > 1).any()) for c in covered.values()
    )


def kill_and_resume(name: str, workers: int, a, lengths: dict[int, int]) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"lmpipe-peers-{name}-") as tmp:
        d = Path(tmp)
        log = d / "docs.jsonl"
        if name.startswith("lmpipe"):
            data = [a.shards] if name == "lmpipe-shards" else a.text
            cmd = [sys.executable, "-m", "lmpipe", "run", "--consume-only", "--data", *data, "--tokenizer", a.tok,
                   "--seq-len", str(a.resume_seq_len), "--batch-size", str(a.resume_batch_size), "--epochs", "1",
                   "--steps", "0", "--producers", str(workers), "--checkpoint-dir", str(d / "ck"),
                   "--checkpoint-every", str(a.checkpoint_every), "--doc-log", str(log), "--resume", "auto",
                   "--metrics-port", "-1", "--port", str(free_port_pair()), "--device", a.device]  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "bench.peers", "--child", "train", "--loader", name, "--workers",
                   str(workers), "--dir", str(d), *child_args(a, resume=True)]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "LMPIPE_LOG_LEVEL": "WARNING"}
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= a.kill_at:
                break
            time.sleep(0.01)
        kids = children(first.pid)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        finished_first = first.returncode == 0
        for k in kids:  # workers and producers go with their parent; wait for them
            while (
                Path(f"/proc/{k}").exists()
                and "zombie" not in Path(f"/proc/{k}/status").read_text(errors="replace").lower()
            ):
                time.sleep(0.05)
        killed_at = len(log.read_text().splitlines())
        first_session = json.loads(log.read_text().splitlines()[0])["batches"][0]["session"]
        if name.startswith("lmpipe"):
            from lmpipe.consumer.checkpoint import CheckpointManager

            resumed = CheckpointManager(d / "ck").latest_step() or 0
        else:
            resumed = torch.load(d / "ck.pt", weights_only=True)["step"] if (d / "ck.pt").exists() else 0
        t0 = time.perf_counter()
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if second.returncode != 0:
            raise SystemExit(
                f"{name}: the resumed run failed:\n{second.stdout[-2000:]}{second.stderr[-2000:]}"
            )
        lost, repeated = lost_and_repeated(log, first_session, resumed, lengths)
        return {"killed_at": killed_at, "resumed": resumed, "lost": lost, "repeated": repeated,
                "resume_seconds": time.perf_counter() - t0, "valid": not finished_first}  # fmt: skip


def child_args(a, resume: bool = False) -> list[str]:
    seq, rows = (a.resume_seq_len, a.resume_batch_size) if resume else (a.seq_len, a.batch_size)
    return ["--text", *a.text, "--tok", a.tok, "--shards", a.shards, "--mds", a.mds_resume if resume else a.mds,
            "--seq-len", str(seq), "--batch-size", str(rows), "--device", a.device, "--warmup", str(a.warmup),
            "--seconds", str(a.seconds), "--checkpoint-every", str(a.checkpoint_every),
            "--model", "none" if resume else a.model, *([] if a.compile else ["--no-compile"])]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--workers", default="1,2,4,8", help="workers / producers (capped at the cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--model", default="none", help="none: the consume-only step; else a model preset trained")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="CUDA: the model uncompiled")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--resume-seq-len", type=int, default=128, help="the kill -9 runs: short rows, many steps")
    p.add_argument("--resume-batch-size", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--kill-at", type=int, default=120, help="steps logged before the kill -9")
    p.add_argument("--no-resume", dest="resume", action="store_false", help="skip the kill -9 runs")
    p.add_argument("--work", default="/tmp/lmpipe-bench")
    p.add_argument("--out", default=None)
    # a child's own arguments
    p.add_argument("--child", choices=("throughput", "train"), help=argparse.SUPPRESS)
    p.add_argument("--loader", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--text", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    p.add_argument("--mds", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if a.child:
        a.workers = int(a.workers)
        if a.child == "throughput":
            print("RESULT " + json.dumps(child_throughput(a)), flush=True)
        else:
            child_train(a)
        return

    cores = os.cpu_count() or 1
    counts = [n for n in map(int, a.workers.split(",")) if n <= cores]
    loaders = []
    for name in a.loaders.split(","):
        try:
            if name in PACKAGES:
                __import__(PACKAGES[name]) if name != "streaming" else (
                    _stub_torchvision(),
                    __import__("streaming"),
                )
            loaders.append(name)
        except ImportError as exc:
            print(f"{name}: skipped ({exc}; pip install 'lmpipe[bench]')", flush=True)
    a.tok, a.shards = bench_data(Path(a.work))
    a.text = [str(WIKITEXT / "valid.txt"), str(WIKITEXT / "test.txt")]
    a.mds = str(Path(a.work) / f"wt2-mds-{a.seq_len}x{a.batch_size}")
    a.mds_resume = str(Path(a.work) / f"wt2-mds-{a.resume_seq_len}x{a.resume_batch_size}")
    if "streaming" in loaders:
        for path, seq, rows in (
            (a.mds, a.seq_len, a.batch_size),
            (a.mds_resume, a.resume_seq_len, a.resume_batch_size),
        ):
            if not (Path(path) / "index.json").exists():
                write_mds(a.text, a.tok, seq, rows, Path(path))
    lengths = doc_lengths(a)

    results: dict[tuple[str, int], dict] = {}
    for n in counts:
        for name in loaders:
            cmd = [sys.executable, "-m", "bench.peers", "--child", "throughput", "--loader", name, "--workers", str(n),
                   *child_args(a)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name}, {n} workers failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
            r = json.loads(line[7:])
            if a.resume:
                r |= kill_and_resume(name, n, a, lengths)
            results[(name, n)] = r
            print(f"{name}, {n} worker(s): {r['tokens_per_second']:,.0f} tokens/s, first batch {r['first_batch']:.2f} s, "
                  f"first step {r['first_step']:.2f} s, "
                  f"{r['memory'] / 2**20:,.0f} MiB" + (f", lost {r['lost']}, repeated {r['repeated']}" if a.resume else ""),
                  flush=True)  # fmt: skip

    rows = []
    for (name, n), r in results.items():
        kind = INPUT[name]
        ref = results.get((REFERENCE[kind], n))
        best = max(v["tokens_per_second"] for (x, k), v in results.items() if k == n and INPUT[x] == kind)
        row = [name, kind, n, r["tokens_per_second"], r["tokens_per_second"] / ref["tokens_per_second"] if ref else "",
               "yes" if r["tokens_per_second"] == best else "", 100 * r["data_wait"], r["first_batch"],
               r["first_step"], r["memory"] / 2**20]  # fmt: skip
        if a.resume:
            row += [f"{r['killed_at']} / {r['resumed']}" + ("" if r["valid"] else " (epoch ended first)"),
                    r["lost"], r["repeated"], r["resume_seconds"]]  # fmt: skip
        rows.append(row)
    headers = [
        "loader",
        "input",
        "workers",
        "tokens/s",
        "vs lmpipe (same input)",
        "fastest (same input)",
        "wait %",
        "first batch delivered s",
        "first step s",
        "peak MiB",
    ]
    if a.resume:
        headers += ["killed at / resumed from step", "docs lost", "docs repeated", "resumed epoch s"]
    body = (
        f"WikiText-2 valid+test ({len(lengths):,} documents, {sum(lengths.values()):,} tokens), a 32k BPE, pack, "
        f"T={a.seq_len}, {a.batch_size} rows; consumer: "
        + ("the trainer's consume-only step" if a.model == "none" else f"lmpipe's trainer training {a.model}")
        + f" on {a.device}. "
        f"{cores} cores, one per worker or producer. tokens/s over {a.seconds:.0f} s after {a.warmup:.0f} s of "
        f"warm-up; wait %: the consumer's time blocked on the loader. First batch delivered: from the start to "
        "the first batch in the consumer's hands (a PyTorch loader's iterator returned it; lmpipe's trainer "
        "received and validated it), the loader's own start-up; first step: to the end of the first step on "
        "it, the consumer's build"
        + (" and compile" if a.model != "none" and a.compile and a.device.startswith("cuda") else "")
        + " included, alike for every loader (lmpipe compiles while its producers deliver). "
        f"Kill -9 runs: T={a.resume_seq_len}, "
        f"{a.resume_batch_size} rows, one epoch, a checkpoint every {a.checkpoint_every} steps, the consumer "
        f"killed after {a.kill_at} steps and resumed from its last checkpoint (a plain DataLoader, which has "
        "no state, starts the epoch again); a document counts as lost if a token of it was never trained, "
        "repeated if one was trained twice. Load average at the end: "
        f"{os.getloadavg()[0]:.1f}.\n\n" + table(headers, rows)
    )
    print(body)
    name = "peers" if a.model == "none" else f"peers-{a.model}"
    write_result(name, "lmpipe against DataLoader, StatefulDataLoader and MosaicML Streaming", body, a.out)


if __name__ == "__main__":
    main()
