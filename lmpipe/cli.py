"""`lmpipe` console script: one entry point, a subcommand per job.

lmpipe run        N producer processes + the trainer, on this machine (the default job)
lmpipe produce    one producer process (connects to a trainer)
lmpipe train      the trainer (binds; producers connect to it)
lmpipe tokenizer  train or inspect a tokenizer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time

from lmpipe.shared.config import add_pipeline_args, pipeline_from_args

log = logging.getLogger("lmpipe")


def add_train_args(p: argparse.ArgumentParser) -> None:
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.model import PRESETS

    d = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=os.environ.get("LMPIPE_MODEL", d.model),
        help="model preset (default: %(default)s)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=int(os.environ.get("LMPIPE_STEPS", d.steps)),
        help="optimizer steps; 0 = until the producers' epochs are done (default: %(default)s)",
    )
    g.add_argument(
        "--accum", type=int, default=d.accum, help="micro-batches per optimizer step (default: %(default)s)"
    )
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps (default: %(default)s)")
    g.add_argument(
        "--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr"
    )
    g.add_argument("--lr-decay-steps", type=int, default=d.lr_decay_steps, help="cosine horizon (0: --steps)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="clip the global grad norm (0: off)")
    g.add_argument(
        "--device", default=os.environ.get("LMPIPE_DEVICE", d.device), help="auto | cpu | cuda | cuda:N"
    )
    g.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default=os.environ.get("LMPIPE_PRECISION", d.precision),
        help="auto: bf16 on CUDA, fp32 on CPU",
    )
    g.add_argument(
        "--loss-scale",
        default=os.environ.get("LMPIPE_LOSS_SCALE", d.loss_scale),
        metavar="dynamic|static:VALUE|none",
        help="fp16 loss scaling (default: %(default)s)",
    )
    g.add_argument("--no-tf32", dest="tf32", action="store_false", help="no TF32 for fp32 matmuls on CUDA")
    g.add_argument(
        "--fused-ce",
        action="store_true",
        help="liger-kernel's fused linear + cross-entropy on CUDA: far less memory, one host sync a step",
    )
    g.add_argument(
        "--vocab-size", type=int, default=d.vocab_size, help="model vocabulary (0: the tokenizer's)"
    )
    g.add_argument(
        "--attention",
        choices=("auto", "flex", "dense"),
        default=d.attention,
        help="packed rows: FlexAttention (CUDA default) or an exact dense mask",
    )
    g.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false", help="use foreach AdamW")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument(
        "--compile",
        action="store_true",
        default=os.environ.get("LMPIPE_COMPILE", "") in ("1", "true"),
        help="torch.compile the model",
    )
    g.add_argument(
        "--no-copy-stream",
        dest="copy_stream",
        action="store_false",
        help="copy batches on the compute stream (ablation)",
    )
    g.add_argument(
        "--log-every", type=int, default=d.log_every, help="steps between status lines (default: %(default)s)"
    )
    g.add_argument("--slots", type=int, default=d.slots, help="pinned host slots (0: 2*accum+2)")
    g.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0: torch's default)")
    g.add_argument("--train-seed", type=int, default=d.seed, help="model init seed")
    g.add_argument("--doc-log", metavar="FILE", help="append the document pieces of every step as JSON lines")
    g.add_argument("--summary-json", metavar="FILE", help="write the end-of-run summary as JSON")
    c = p.add_argument_group("checkpoints")
    c.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("LMPIPE_CHECKPOINT_DIR"),
        metavar="DIR",
        help="where checkpoints go (none: no checkpoints)",
    )
    c.add_argument(
        "--checkpoint-every",
        type=int,
        default=int(os.environ.get("LMPIPE_CHECKPOINT_EVERY", 0)),
        metavar="STEPS",
        help="also checkpoint every STEPS steps (always: at the end and on SIGTERM)",
    )
    c.add_argument(
        "--keep-checkpoints", type=int, default=3, metavar="K", help="keep the last K (default: %(default)s)"
    )
    c.add_argument(
        "--resume",
        default=os.environ.get("LMPIPE_RESUME"),
        metavar="auto|PATH",
        help="auto: the latest checkpoint in --checkpoint-dir if any; PATH: that checkpoint",
    )
    g.add_argument(
        "--wait-timeout",
        type=float,
        default=d.wait_timeout,
        help="stop when no batch arrived for this many seconds (0: wait forever)",
    )


def train_config_from_args(ns: argparse.Namespace, metrics_port: int | None):
    from lmpipe.consumer.config import TrainConfig

    return TrainConfig(
        model=ns.model,
        steps=ns.steps,
        accum=ns.accum,
        lr=ns.lr,
        warmup=ns.warmup,
        min_lr_ratio=ns.min_lr_ratio,
        lr_decay_steps=ns.lr_decay_steps,
        weight_decay=ns.weight_decay,
        grad_clip=ns.grad_clip,
        device=ns.device,
        precision=ns.precision,
        loss_scale=ns.loss_scale,
        fused_ce=ns.fused_ce,
        tf32=ns.tf32,
        vocab_size=ns.vocab_size,
        attention=ns.attention,
        fused_adamw=ns.fused_adamw,
        grad_checkpointing=ns.grad_checkpointing,
        compile=ns.compile,
        copy_stream=ns.copy_stream,
        log_every=ns.log_every,
        slots=ns.slots,
        threads=ns.threads,
        seed=ns.train_seed,
        metrics_port=metrics_port,
        doc_log=ns.doc_log,
        wait_timeout=ns.wait_timeout,
        checkpoint_dir=ns.checkpoint_dir,
        checkpoint_every=ns.checkpoint_every,
        keep_checkpoints=ns.keep_checkpoints,
        resume=ns.resume,
    )


def _metrics_arg(p: argparse.ArgumentParser, default: int, what: str) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("LMPIPE_METRICS_PORT", default)),
        help=f"Prometheus /metrics port for {what} (0: any free port, -1: off; default: %(default)s)",
    )
    p.add_argument(
        "--metrics-linger",
        type=float,
        default=float(os.environ.get("LMPIPE_METRICS_LINGER", 0)),
        metavar="SECONDS",
        help="keep /metrics up this long after the work is done, for a last scrape (default: %(default)s)",
    )


def linger(seconds: float) -> None:
    """Sleep after the work, /metrics still served by its daemon thread; a signal cuts it short."""
    if seconds <= 0:
        return
    log.info("work done; serving metrics for %.0f s more", seconds)
    with contextlib.suppress(KeyboardInterrupt):
        time.sleep(seconds)


def build_parser(with_training: bool = True) -> argparse.ArgumentParser:
    """`with_training=False` leaves out the trainer's flags, whose defaults import torch: a producer
    process (`lmpipe produce`) then starts without it."""
    p = argparse.ArgumentParser(
        prog="lmpipe", description="Stream packed LM batches over ZeroMQ into a GPT trainer."
    )
    p.add_argument("--log-level", default=os.environ.get("LMPIPE_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    r = sub.add_parser(
        "run",
        help="start N producers and the trainer on this machine",
        description="Start --producers producer processes and train in this process; "
        "with no --data, on the built-in corpus and tokenizer.",
    )
    add_pipeline_args(r)
    if with_training:
        add_train_args(r)
    _metrics_arg(r, 9400, "the trainer (producer i uses port+1+i)")
    r.set_defaults(func=cmd_run)

    pr = sub.add_parser(
        "produce", help="run one producer", description="Tokenize, batch and stream to a trainer."
    )
    add_pipeline_args(pr)
    pr.add_argument(
        "--worker",
        type=int,
        default=int(os.environ.get("LMPIPE_WORKER", -1)),
        help="worker id in 0..producers-1; -1 (default): the trainer assigns a free one, "
        "so `docker compose --scale producer=N` needs no per-replica settings",
    )
    pr.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    _metrics_arg(pr, 9401, "this producer")
    pr.set_defaults(func=cmd_produce)

    t = sub.add_parser("train", help="run the trainer", description="Bind, wait for producers, train.")
    add_pipeline_args(t)
    if with_training:
        add_train_args(t)
    _metrics_arg(t, 9400, "the trainer")
    t.set_defaults(func=cmd_train)

    tk = sub.add_parser("tokenizer", help="train or inspect a tokenizer")
    tk.add_argument("action", choices=("train", "info"))
    tk.add_argument(
        "--data", nargs="*", default=[], metavar="PATH", help="corpus to train on (default: built-in)"
    )
    tk.add_argument("--vocab-size", type=int, default=4096)
    tk.add_argument("--out", help="where to write tokenizer.json (train)")
    tk.add_argument("--tokenizer", help="tokenizer.json to inspect (info; default: built-in)")
    tk.add_argument("--builtin", action="store_true", help="rebuild the shipped built-in tokenizer")
    tk.set_defaults(func=cmd_tokenizer)

    pp = sub.add_parser(
        "prepare",
        help="tokenize a corpus once into memory-mapped shards",
        description="Tokenize text/JSONL into shards that producers serve with no tokenizing (--data DIR).",
    )
    pp.add_argument(
        "--data", nargs="+", required=True, metavar="PATH", help="text/JSONL files or directories"
    )
    pp.add_argument("--out", required=True, metavar="DIR", help="shard directory to create")
    pp.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: built-in)")
    pp.add_argument("--doc-split", choices=("blank", "heading"), default="blank")
    pp.add_argument(
        "--shard-tokens", type=int, default=1 << 26, help="tokens per shard file (default: %(default)s)"
    )
    pp.add_argument("--max-line-bytes", type=int, default=1 << 20)
    pp.add_argument("--force", action="store_true", help="replace --out if it exists")
    pp.set_defaults(func=cmd_prepare)

    ky = sub.add_parser("keys", help="make ZeroMQ CURVE keys for --curve-dir")
    ky.add_argument("--out", required=True, metavar="DIR")
    ky.set_defaults(func=cmd_keys)

    ex = sub.add_parser("export", help="write a checkpoint's weights as safetensors")
    ex.add_argument("checkpoint", help="a checkpoint directory, or a --checkpoint-dir (its latest)")
    ex.add_argument("--out", required=True, help="output .safetensors file")
    ex.set_defaults(func=cmd_export)
    return p


def cmd_produce(ns: argparse.Namespace) -> int:
    from lmpipe.producer.manager import Producer, ProducerOptions, install_signal_handlers
    from lmpipe.shared.log import setup

    cfg = pipeline_from_args(ns)
    setup("producer" if ns.worker < 0 else f"producer {ns.worker}", ns.log_level)
    p = Producer(
        cfg,
        ProducerOptions(worker=ns.worker, metrics_port=ns.metrics_port, exit_with_parent=ns.exit_with_parent),
    )
    install_signal_handlers(p)
    code = p.run()
    if not p.interrupted:
        linger(ns.metrics_linger)
    return code


def _trainer_signals(trainer) -> None:
    def handler(signum, _frame):
        name = signal.Signals(signum).name
        log.info("%s: finishing the current step, then stopping", name)
        trainer.request_stop(name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_train(ns: argparse.Namespace) -> int:
    from lmpipe.consumer.report import print_status
    from lmpipe.consumer.trainer import Trainer

    cfg = pipeline_from_args(ns)
    tcfg = train_config_from_args(ns, ns.metrics_port)
    trainer = Trainer(cfg, tcfg)
    _trainer_signals(trainer)
    summary = trainer.run(progress=lambda step, st: print_status(step, st, tcfg.steps))
    if trainer.dist.is_main:  # under torchrun, rank 0 reports for the job
        report(summary, ns.summary_json)
    if not trainer.interrupted:
        linger(ns.metrics_linger)
    return 0


def report(summary, path: str | None) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\n")  # end the live status line
    print(summary.render(), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(summary.to_dict(), f, indent=1)


def cmd_run(ns: argparse.Namespace) -> int:
    from lmpipe.launch import run_local

    return run_local(ns)


def cmd_tokenizer(ns: argparse.Namespace) -> int:
    from lmpipe.producer.sources import Corpus
    from lmpipe.shared.tokenizer import BUILTIN_PATH, load_tokenizer, train_tokenizer

    if ns.action == "info":
        info = load_tokenizer(ns.tokenizer)
        print(
            f"{info.path}\n  vocab size {info.vocab_size}, end-of-text id {info.eos_id}, pad id {info.pad_id}, hash {info.hash}"
        )
        return 0
    out = BUILTIN_PATH if ns.builtin else ns.out
    if not out:
        print("lmpipe tokenizer train: --out FILE (or --builtin) is required", file=sys.stderr)
        return 2
    corpus = Corpus(ns.data, builtin_docs=5000)
    texts = (r.text for r in corpus.records() if r.text and r.bad is None)
    print(f"training a {ns.vocab_size}-token byte-level BPE on {corpus.describe()}", file=sys.stderr)
    tok = train_tokenizer(texts, ns.vocab_size)
    tok.save(str(out))
    info = load_tokenizer(out)
    print(f"wrote {out}: vocab size {info.vocab_size}, hash {info.hash}")
    return 0


def cmd_prepare(ns: argparse.Namespace) -> int:
    from lmpipe.producer.shards import prepare
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.tokenizer import load_tokenizer

    tok = load_tokenizer(ns.tokenizer)
    corpus = Corpus(
        ns.data, doc_split=ns.doc_split, max_line_bytes=ns.max_line_bytes, vocab_size=tok.vocab_size
    )
    if corpus.random_access:
        raise ValueError("--data must be text or JSONL files, not the built-in corpus or shards")
    bad: dict[str, int] = {}

    def on_bad(reason: str, where: str, detail: str) -> None:
        bad[reason] = bad.get(reason, 0) + 1
        log.warning("%s: %s (%s), skipped", where, detail, reason)

    stream = DocStream(corpus, tok, shuffle_window=0, on_bad=on_bad)
    meta = prepare(stream, ns.out, shard_tokens=ns.shard_tokens, source=corpus.fingerprint(), force=ns.force)
    skipped = f"; skipped {sum(bad.values())} bad records ({bad})" if bad else ""
    print(
        f"wrote {ns.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens, {len(meta['shards'])} shard(s){skipped}"
    )
    return 0


def cmd_keys(ns: argparse.Namespace) -> int:
    from lmpipe.shared.security import generate_keys

    out = generate_keys(ns.out)
    print(f"wrote CURVE keys to {out}: give the trainer the directory, each producer client.key_secret and "
          "server.key (--curve-dir); add public keys of other producers to authorized/")  # fmt: skip
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from lmpipe.consumer.checkpoint import export_safetensors, resolve_resume

    path = resolve_resume(ns.checkpoint, None)
    meta = export_safetensors(path, Path(ns.out))
    print(f"wrote {ns.out} from {path} (step {meta['step']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = next(
        (a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "--log-level")),
        None,
    )
    ns = build_parser(with_training=command not in ("produce", "tokenizer", "prepare", "keys")).parse_args(
        args
    )
    if ns.cmd != "produce":
        from lmpipe.shared.log import setup

        setup("trainer" if ns.cmd in ("run", "train") else "lmpipe", ns.log_level)
    try:
        return ns.func(ns)
    except (ValueError, OSError) as exc:  # bad input or config, a refused checkpoint: say it, exit 2
        log.debug("details", exc_info=True)
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
