"""`lmpipe` console script: one entry point, a subcommand per job.

lmpipe run        N producer processes + the trainer, on this machine (the default job)
lmpipe produce    one producer process (connects to a trainer)
lmpipe train      the trainer (binds; producers connect to it)
lmpipe tokenizer  train or inspect a tokenizer
lmpipe prepare    tokenize a corpus once into memory-mapped shards
lmpipe keys       make ZeroMQ CURVE keys
lmpipe export     write a checkpoint's weights as safetensors
lmpipe plot       a picture of a run (loss, tokens/s, data wait) from its --summary-json
lmpipe health     is the process at a metrics port making progress? (container health checks)

Every flag is a dataclass field (shared/settings.py): the parser is generated from PipelineConfig,
TrainConfig and the classes in lmpipe/options.py, and parsing gives those dataclasses, validated. A usage
mistake is one line on stderr and exit status 2. Nothing here imports torch until a trainer is built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from lmpipe import __version__
from lmpipe.consumer.config import TRAINING, TrainConfig
from lmpipe.options import (
    ExportOptions,
    GlobalOptions,
    HealthOptions,
    KeysOptions,
    PlotOptions,
    PrepareOptions,
    ProduceOptions,
    ReportOptions,
    TokenizerOptions,
)
from lmpipe.shared.config import BATCHING, PipelineConfig
from lmpipe.shared.settings import Parser, SettingsError, add_settings, from_args, name_sources

if TYPE_CHECKING:
    from lmpipe.producer.records import Record

log = logging.getLogger("lmpipe")

GLOBAL = "global options (before or after the command)"
CORPUS = (
    "data",
    "tokenizer",
    "doc_split",
    "text_column",
    "max_line_bytes",
)  # the one-shot commands' share of PipelineConfig
CORPUS_FILES = (
    "corpus files (text, JSONL, .gz/.zst, Parquet, Arrow), directories or fsspec URLs (s3://...) of them"
)
NOT_SHARDS = "--data must be corpus files (text, JSONL, Parquet, Arrow...), not a prepared shard directory"
ENV_NOTE = (
    "Every option of run, train and produce (and --log-level) can also be set as LMPIPE_<OPTION> in the "
    "environment, e.g. LMPIPE_SEQ_LEN=256, or in a --config FILE (TOML: seq_len = 256); a flag wins over the "
    "variable, the variable over the file. `lmpipe COMMAND --help` lists them; `--dry-run` shows where each "
    "value came from."
)


def build_parser() -> Parser:
    p = Parser(
        prog="lmpipe", description="Stream packed LM batches over ZeroMQ into a GPT trainer.", epilog=ENV_NOTE
    )
    p.add_argument("--version", action="version", version=f"lmpipe {__version__}")
    add_settings(p, GlobalOptions, GLOBAL)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, func, settings: tuple[type, ...], **kwargs) -> Parser:
        c = sub.add_parser(name, **kwargs)
        add_settings(c, GlobalOptions, GLOBAL, fill=False)  # the top-level parser fills it
        c.set_defaults(func=func, settings=settings)
        return c

    for name, func, what in (
        ("run", cmd_run, ("start N producers and the trainer on this machine", "Start --producers producer "
                          "processes and train in this process; with no --data (nor --mix), on the built-in corpus and "
                          "tokenizer.")),
        ("train", cmd_train, ("run the trainer", "Bind, wait for producers, train.")),
    ):  # fmt: skip
        t = command(
            name, func, (PipelineConfig, TrainConfig, ReportOptions), help=what[0], description=what[1]
        )
        add_settings(t, PipelineConfig, BATCHING)
        add_settings(t, TrainConfig, TRAINING)
        add_settings(t, ReportOptions, "reporting")

    _add_commands(command)
    return p


def _add_commands(command) -> None:
    """The producer's and the one-shot commands (`command(name, func, settings, **kwargs)` adds one)."""
    pr = command(
        "produce",
        cmd_produce,
        (PipelineConfig, ProduceOptions),
        help="run one producer",
        description="Tokenize, batch and stream to a trainer.",
    )
    add_settings(pr, PipelineConfig, BATCHING, hidden=("producers",))  # how many `lmpipe run` starts
    add_settings(pr, ProduceOptions, "producer")

    tk = command(
        "tokenizer",
        cmd_tokenizer,
        (PipelineConfig, TokenizerOptions),
        help="train or inspect a tokenizer",
        description="train: a byte-level BPE on --data (default: the built-in corpus); info: describe --tokenizer.",
    )
    tk.add_argument("action", choices=("train", "info"))
    corpus = {"data": f"train: {CORPUS_FILES}; none: the built-in corpus (see README, Corpora)"}
    add_settings(tk, PipelineConfig, "corpus", only=CORPUS, env=False, helps=corpus)
    add_settings(tk, TokenizerOptions, "tokenizer", env=False)

    pp = command(
        "prepare",
        cmd_prepare,
        (PipelineConfig, PrepareOptions),
        help="tokenize a corpus once into memory-mapped shards",
        description="Tokenize text/JSONL into shards that producers serve with no tokenizing (--data DIR).",
    )
    corpus = {"data": f"{CORPUS_FILES} (see README, Corpora)"}
    add_settings(pp, PipelineConfig, "corpus", only=CORPUS, env=False, required=("data",), helps=corpus)
    add_settings(pp, PrepareOptions, "shards", env=False)

    ky = command("keys", cmd_keys, (KeysOptions,), help="make ZeroMQ CURVE keys for --curve-dir")
    add_settings(ky, KeysOptions, "keys", env=False)

    ex = command("export", cmd_export, (ExportOptions,), help="write a checkpoint's weights as safetensors")
    ex.add_argument("checkpoint", help="a checkpoint directory, or a --checkpoint-dir (its latest)")
    add_settings(ex, ExportOptions, "export", env=False)

    he = command(
        "health",
        cmd_health,
        (HealthOptions,),
        help="exit 0 if the lmpipe process at --metrics-port makes progress (a container health check)",
        description="Read the /metrics of a trainer or producer on this host. A trainer is healthy while it "
        "steps (its latest step, or its start, less than --stalled-after ago); a producer while it answers. "
        "One line on stdout says what was seen; exit 0 healthy, 1 not.",
    )
    add_settings(he, HealthOptions, "health", env=False)

    pl = command(
        "plot",
        cmd_plot,
        (PlotOptions,),
        help="draw loss, eval loss, learning rate, tokens/s and data wait over steps from --summary-json files",
        description="A picture of one run or several on one figure: training loss (and the held-out eval "
        "loss), learning rate, tokens/s and data wait at each logging interval, each run's summary numbers in "
        "its legend (needs matplotlib: pip install 'lmpipe[plot]').",
    )
    pl.add_argument("summary", nargs="+", help="files written by --summary-json, one run each")
    add_settings(pl, PlotOptions, "plot", env=False)


# -- commands: each gets the namespace, the global options and its settings, built and validated ---------


def _need_torch() -> None:
    """The trainer's commands, where torch (an extra) is missing: one line saying how to add it."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise SettingsError(
            f"the trainer needs PyTorch, which this install lacks ({exc}; producer-only installs leave it "
            "out): pip install 'lmpipe[train]', or torch from PyTorch's index (README)"
        ) from None


def cmd_run(ns, g: GlobalOptions, cfg: PipelineConfig, tcfg: TrainConfig, opts: ReportOptions) -> int:
    _need_torch()
    if opts.dry_run:
        from lmpipe.dryrun import dry_run_train

        return dry_run_train(ns, g, cfg, tcfg, opts, local_producers=True)
    from lmpipe.launch import train

    return train(cfg, tcfg, opts, local_producers=True, log_level=g.log_level)


def cmd_train(ns, g: GlobalOptions, cfg: PipelineConfig, tcfg: TrainConfig, opts: ReportOptions) -> int:
    _need_torch()
    if opts.dry_run:
        from lmpipe.dryrun import dry_run_train

        return dry_run_train(ns, g, cfg, tcfg, opts, local_producers=False)
    from lmpipe.launch import train

    return train(cfg, tcfg, opts, local_producers=False, log_level=g.log_level)


def cmd_produce(ns, g: GlobalOptions, cfg: PipelineConfig, opts: ProduceOptions) -> int:
    if opts.dry_run:
        from lmpipe.dryrun import dry_run_produce

        return dry_run_produce(ns, g, cfg, opts)
    from lmpipe.procs import produce

    return produce(cfg, opts)


def cmd_tokenizer(ns, g: GlobalOptions, cfg: PipelineConfig, opts: TokenizerOptions) -> int:
    from lmpipe.checks import check_tokenizer, first_document, open_corpus
    from lmpipe.producer.records import BadRecords
    from lmpipe.progress import Progress, duration, text_bytes
    from lmpipe.shared.tokenizer import BUILTIN_PATH, load_tokenizer, train_tokenizer

    if ns.action == "info":
        info = check_tokenizer(cfg)
        print(
            f"{info.path}\n  vocab size {info.vocab_size}, end-of-text id {info.eos_id}, pad id {info.pad_id}, hash {info.hash}"
        )
        return 0
    out = BUILTIN_PATH if opts.builtin else opts.out
    if not out:
        raise SettingsError("train needs --out FILE (or --builtin)")
    corpus = open_corpus(replace(cfg, builtin_docs=5000))  # the built-in tokenizer's corpus
    if corpus.shards is not None:  # (the built-in corpus is random-access too)
        raise SettingsError(NOT_SHARDS)
    check_tokenizer_out(str(out), corpus)  # every mistake before the training, not at its end
    first_document(corpus, text=True)
    bad = BadRecords(log)  # each bad record said (the first few) and counted, as `prepare` does
    texts = _texts(corpus.records(), bad)
    print(f"training a {opts.vocab_size}-token byte-level BPE on {corpus.describe()}", file=sys.stderr)
    progress = Progress("reading", text_bytes(corpus))  # a percentage and ETA where the size is known
    tok = train_tokenizer(
        progress.texts(texts, then="learning the merges"), opts.vocab_size, show_progress=progress.tty
    )
    try:
        tok.save(str(out))
    except Exception as exc:  # the tokenizers library's own: "Is a directory (os error 21)"
        raise SettingsError(f"--out {out}: cannot write it ({exc})") from None
    info = load_tokenizer(out)
    took = duration(time.monotonic() - progress.start)
    skipped = f"; {bad.summary()}" if bad.total else ""
    print(f"wrote {out}: vocab size {info.vocab_size}, hash {info.hash} (in {took}){skipped}")
    if info.vocab_size < opts.vocab_size:  # BPE stops when no pair is left to merge
        print(
            f"note: {info.vocab_size:,} tokens, not the {opts.vocab_size:,} asked for: the corpus has too little "
            "text for more merges (give more --data for a larger vocabulary)",
            file=sys.stderr,
        )
    return 0


def _texts(records: Iterable[Record], bad: Callable[[str, str, str], None]) -> Iterator[str]:
    """The text of each good record (its prompt too); each bad one goes to `bad` (reason, where, why)."""
    for r in records:
        if r.bad is not None:
            bad(r.bad[0], r.where, r.bad[1])
        elif r.text:
            yield (r.prompt or "") + r.text


def check_tokenizer_out(out: str, corpus) -> None:
    """tokenizer train's --out can be written, and is no corpus file it reads (replaced with JSON before)."""
    from lmpipe.checks import check_writable

    check_writable("--out", out)  # a directory, a missing or read-only folder
    if not Path(out).exists():
        return
    for f in corpus.paths:
        if f.remote is None and os.path.samefile(f.path, out):
            raise SettingsError(
                f"--out {out} is the corpus file {f.path}: training would replace it; choose another --out"
            )


def cmd_prepare(ns, g: GlobalOptions, cfg: PipelineConfig, opts: PrepareOptions) -> int:
    with _sigterm_exits():
        return _prepare(cfg, opts)


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM (a scheduler's kill, `timeout`) ends the command as Ctrl-C does, through its cleanup (prepare's
    half-written temporary folder, which the default action left beside --out); the old handler after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _prepare(cfg: PipelineConfig, opts: PrepareOptions) -> int:
    from typing import cast

    from lmpipe.checks import check_tokenizer, check_writable, first_document, open_corpus, say_left_out
    from lmpipe.producer.shards import check_out, prepare
    from lmpipe.producer.sources import BadRecords, Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.progress import CountedCorpus, Progress, text_bytes

    tok = check_tokenizer(cfg)
    corpus = open_corpus(cfg, tok.vocab_size)
    if corpus.random_access:
        raise SettingsError(NOT_SHARDS)
    first_document(corpus)
    assert opts.out is not None  # a required setting
    inputs = [f.path for f in corpus.paths if f.remote is None]
    check_out(Path(opts.out), opts.force, inputs)  # every mistake before the first info line
    check_writable("--out", opts.out, directory=True)  # /proc, /sys: refused before the work, not after
    say_left_out(cfg.data)
    bad = BadRecords(log)

    # records read (bad ones too), with a percentage and ETA where the corpus's size is known
    progress = Progress("tokenizing", text_bytes(corpus), unit="records")
    stream = DocStream(cast(Corpus, CountedCorpus(corpus, progress)), tok, shuffle_window=0, on_bad=bad)
    meta = prepare(
        stream,
        opts.out,
        shard_tokens=opts.shard_tokens,
        source=corpus.fingerprint(),
        force=opts.force,
        progress=False,  # ours, with the corpus's size
        inputs=inputs,
    )
    progress.done()
    skipped = f"; {bad.summary()}" if bad.total else ""
    print(
        f"wrote {opts.out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens, {len(meta['shards'])} shard(s){skipped}"
    )
    return 0


def cmd_keys(ns, g: GlobalOptions, opts: KeysOptions) -> int:
    from lmpipe.shared.security import generate_keys

    assert opts.out is not None  # a required setting
    try:
        out = generate_keys(opts.out)
    except ValueError as exc:  # keys already there, a file: the usage mistake's one line
        raise SettingsError(str(exc)) from None
    print(f"wrote CURVE keys to {out}: give the trainer the directory, each producer client.key_secret and "
          "server.key (--curve-dir); add public keys of other producers to authorized/")  # fmt: skip
    return 0


def cmd_export(ns, g: GlobalOptions, opts: ExportOptions) -> int:
    from pathlib import Path

    _need_torch()
    from lmpipe.consumer.checkpoint import CheckpointManager, export_safetensors

    given = Path(ns.checkpoint)  # a checkpoint, or a --checkpoint-dir: its latest
    path = given if (given / "header.json").is_file() else CheckpointManager(given).latest()
    if path is None:
        raise SettingsError(
            f"{ns.checkpoint}: no checkpoint there (name one, or a --checkpoint-dir holding some)"
        )
    assert opts.out is not None  # a required setting
    out = Path(opts.out)
    if not opts.out or out.is_dir():
        raise SettingsError(f"--out {opts.out!r}: name the .safetensors file to write, not a directory")
    if not out.parent.is_dir():
        raise SettingsError(f"--out {opts.out}: no folder {out.parent} to write it in")
    if out.resolve().parent == path.resolve():
        raise SettingsError(f"--out {opts.out} is inside the checkpoint {path}; write it elsewhere")
    replaced = out.exists()
    meta = export_safetensors(path, out)
    print(
        f"wrote {opts.out} from {path} (step {meta['step']}){', replacing the file there' if replaced else ''}"
    )
    return 0


def cmd_plot(ns, g: GlobalOptions, opts: PlotOptions) -> int:
    from pathlib import Path

    from lmpipe.plot import plot

    assert opts.out is not None  # a required setting
    runs = plot([Path(s) for s in ns.summary], Path(opts.out), opts.label)
    if len(runs) == 1:
        print(f"wrote {opts.out}: {len(runs[0].rows)} logging intervals of {ns.summary[0]}")
    else:
        each = ", ".join(f"{r.label} ({len(r.rows)} intervals)" for r in runs)
        print(f"wrote {opts.out}: {len(runs)} runs: {each}")
    return 0


def cmd_health(ns, g: GlobalOptions, opts: HealthOptions) -> int:
    from lmpipe.health import check

    return check(opts)


def _role(cmd: str, configs: list) -> str:
    if cmd in ("run", "train"):
        return "trainer"
    if cmd == "produce":
        worker = configs[1].worker
        return "producer" if worker < 0 else f"producer {worker}"
    return "lmpipe"


# torch's OpenMP threads spin while they wait for work by default; beside producers on the same cores (lmpipe
# run on a CPU machine, two jobs on one) the spinning took 1.6x the wall and CPU time of two default jobs run
# at once on 2 cores (OMP_WAIT_POLICY=PASSIVE: 52 s, not 84 s). libgomp reads it when torch
# loads, so it is set before anything imports torch; a user's own value stays.
OMP_WAIT_POLICY = "PASSIVE"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    code = _main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank leaves without the interpreter's teardown, everything written by now: freeing
        # DDP's Reducer after the process group is gone has aborted a rank that had finished its run
        # ("terminate called without an active exception", exit -6: torchrun then fails the job), and
        # freeing it before has deadlocked on gloo's threads (tests/test_distributed.py says how).
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    ns = build_parser().parse_args(argv)  # argparse mistakes exit here: one line, status 2
    prog = f"lmpipe {ns.cmd}"

    def said(exc: Exception) -> str:  # messages name flags; a value from LMPIPE_X is named as that
        return name_sources(str(exc), ns, (GlobalOptions, *ns.settings))

    try:
        g = from_args(ns, GlobalOptions)
        configs = [from_args(ns, cls) for cls in ns.settings]
    except SettingsError as exc:
        print(f"{prog}: {said(exc)}", file=sys.stderr)
        return 2
    from lmpipe.shared.log import setup

    setup(_role(ns.cmd, configs), g.log_level)
    try:
        return ns.func(ns, g, *configs)
    except SettingsError as exc:  # found by a check before any work: a usage mistake
        print(f"{prog}: {said(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # bad input or config, a refused checkpoint: say it, exit 2
        log.debug("details", exc_info=True)
        log.error("%s", said(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a failure that says itself in one line (a torchrun rank lost) carries its code
        code = getattr(exc, "exit_code", None)
        if not isinstance(code, int):
            raise
        log.error("%s", exc)
        return code


if __name__ == "__main__":
    sys.exit(main())
