"""Starting lmpipe's processes: `lmpipe train` and `lmpipe run` (one path), and `lmpipe produce`.

Each first checks what it cheaply can (ports, keys, tokenizer, corpus, device), so that a usage mistake
is one line before a model is built or a process started. `lmpipe run` then forks N producer processes
(before it imports torch: fork_producers) talking to the trainer through the same sockets `lmpipe train` +
`lmpipe produce` use (by default Unix sockets in a directory private to this user; TCP with --curve-dir
or --trusted-network; shared/sockets.py), and trains in this process. They share this process group, so
Ctrl-C reaches all of them; on SIGTERM, or when training ends, the trainer tells them to stop and this
launcher reaps them (terminate, then kill) so nothing is left behind. `--exit-with-parent` makes them quit
if the launcher itself dies without cleaning up.

Layering: the CLI (lmpipe/cli.py) imports this module, never the reverse. torch is imported only once a
trainer is about to be built, so producers never load it.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lmpipe.consumer.config import TrainConfig, per_rank
from lmpipe.options import ProduceOptions, ReportOptions
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.messages import version_location
from lmpipe.shared.settings import SettingsError

if TYPE_CHECKING:
    from lmpipe.producer.sources import Corpus, Record
    from lmpipe.shared.tokenizer import TokenizerInfo

log = logging.getLogger("lmpipe")


# -- checks before anything is built ------------------------------------------------------------------


def check_ports(cfg: PipelineConfig) -> None:
    """The trainer's data and control ports are free: on Unix sockets, no trainer holds the port's lock in
    a private runtime directory; on TCP, a plain bind on --host works, as ZeroMQ's will."""
    from lmpipe.shared.sockets import endpoints

    try:
        ep = endpoints(cfg)
        if ep.kind == "ipc":
            ep.check_free(cfg.port)
            return
    except ValueError as exc:  # the runtime directory is unsafe or unusable
        raise SettingsError(f"--runtime-dir: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"--port {cfg.port}: {exc}") from None
    host = None if cfg.host == "*" else cfg.host
    for port, what in ((cfg.port, "data port"), (cfg.port + 1, "control port (--port + 1)")):
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as exc:
            raise SettingsError(f"--host {cfg.host}: cannot resolve it ({exc.strerror})") from None
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ: TIME_WAIT is no conflict
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise SettingsError(
                        f"--port {cfg.port}: the {what} {cfg.host}:{port} is already in use; choose another --port"
                    ) from None
                raise SettingsError(f"--host {cfg.host}: cannot bind port {port} ({exc.strerror})") from None


def check_keys(cfg: PipelineConfig, *, server: bool) -> None:
    """--curve-dir holds the keys this side needs (the trainer: its pair and authorized/; a producer: its
    pair and the server's public key)."""
    from lmpipe.shared.security import authorized_dir, client_sockets, server_sockets

    if not cfg.curve_dir:
        return
    try:
        if server:
            server_sockets([], cfg.curve_dir)
            authorized_dir(cfg.curve_dir)
        else:
            client_sockets([], cfg.curve_dir)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--curve-dir {cfg.curve_dir}: {exc}") from None


def check_tokenizer(cfg: PipelineConfig) -> TokenizerInfo:
    from lmpipe.shared.tokenizer import load_tokenizer

    try:
        return load_tokenizer(cfg.tokenizer, cfg.data)
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--tokenizer: {exc}") from None


def open_corpus(cfg: PipelineConfig, vocab_size: int | None = None) -> Corpus:
    from lmpipe.producer.sources import Corpus

    try:
        return Corpus.of(cfg, vocab_size)
    except OSError as exc:
        raise SettingsError(f"--data: {exc}") from None


def check_corpus(cfg: PipelineConfig, tok: TokenizerInfo) -> Corpus:
    """The corpus opens, has a document, and, if it is prepared shards, was made with this tokenizer: a
    mistake is one line now, not a producer that stops after the trainer has started."""
    from lmpipe.producer.shards import check_prepared_with

    corpus = open_corpus(cfg, tok.vocab_size)
    if corpus.shards is not None:
        check_prepared_with(corpus.shards, tok)
    first_document(corpus)
    return corpus


_LOCKS: list[int] = []  # the checkpoint folders' lock files this process holds, until it exits


def lock_checkpoint_dir(tcfg: TrainConfig) -> None:
    """One run writes a --checkpoint-dir at a time: two wrote step-N over each other's, and one's clean-up
    removed the other's half-written checkpoint. A POSIX lock on DIR/.lock, held until this process exits
    (the producers it forks do not inherit it); under torchrun rank 0 takes it, the rank that writes."""
    if not tcfg.checkpoint_dir or int(os.environ.get("RANK", "0")) != 0:
        return
    import fcntl

    folder = Path(tcfg.checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # an empty file, never written: a run refused later leaves the folder as it found it
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SettingsError(
            f"--checkpoint-dir {tcfg.checkpoint_dir} is in use by another run; give each run a folder of its own"
        ) from None
    _LOCKS.append(fd)


def check_not_overwritten(tcfg: TrainConfig) -> None:
    """A run without --resume writes step 1, 2, ... into its --checkpoint-dir: an earlier run's checkpoints
    there would be replaced step by step, and rotated away by --keep-checkpoints, without a word."""
    from lmpipe.consumer.checkpoint import CheckpointManager  # torch-free: it reads folder names

    if not tcfg.checkpoint_dir or tcfg.resume:
        return
    step = CheckpointManager(tcfg.checkpoint_dir).latest_step()
    if step is not None:
        raise SettingsError(
            f"--checkpoint-dir {tcfg.checkpoint_dir} holds an earlier run's checkpoints (the latest at step "
            f"{step}), which this run would overwrite: go on from them with --resume auto, or give another "
            "--checkpoint-dir"
        )


def check_resume_corpus(corpus: Corpus, tcfg: TrainConfig) -> None:
    """A checkpoint resumes on the corpus it was trained on: said now, in one line, not by the producers'
    refusal after the model is built (consumer/checkpoint.py reads headers without torch)."""
    from lmpipe.consumer.checkpoint import CheckpointError, read_header, resolve_resume

    try:
        path = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
        header = read_header(path) if path is not None else {}
    except CheckpointError:
        return  # the trainer names what is wrong with the checkpoint itself
    had, now = header.get("data"), corpus.fingerprint()
    stream = header.get("stream")
    had_lines = stream.get("max_line_bytes") if isinstance(stream, dict) else None
    if had and had == now and not corpus.random_access and had_lines not in (None, corpus.max_line_bytes):
        raise SettingsError(  # it decides which lines a document keeps: the cursors would point elsewhere
            f"{path} was trained with --max-line-bytes {had_lines}, this run has --max-line-bytes "
            f"{corpus.max_line_bytes}: resume with the same --max-line-bytes"
        )
    if not had or had == now:
        # the same names and sizes: the same contents, where the checkpoint says them ("": not checked)
        had_content, content = str(header.get("data_content") or ""), corpus.content_digest()
        had_versions = header.get("data_versions")
        versions = corpus.version_digest()
        pinned = (
            {version_location(str(v)): str(v) for v in had_versions} if isinstance(had_versions, list) else {}
        )
        other_content = bool(had_content and content and had_content != content)
        other_versions = bool(versions) and pinned.get(version_location(versions), versions) != versions
        if had and (other_content or other_versions):
            what = "their contents" if other_content else "their versions in the store"
            raise SettingsError(
                f"{path} was trained on --data files of the same names and sizes, but {what} changed "
                "since it was written: its cursors would not follow; resume with the files it was trained "
                "on, or start a new run"
            )
        return
    # a file corpus's fingerprint is "<doc split>|<files>" (Corpus.fingerprint)
    (had_split, _, had_files), (split, _, files) = str(had).partition("|"), now.partition("|")
    if had_files == files and not corpus.random_access:
        raise SettingsError(
            # the value as `--doc-split X`, so that the CLI names LMPIPE_DOC_SPLIT where that gave it
            f"{path} was trained with --doc-split {had_split}, this run has --doc-split {split}: resume with "
            "the same --doc-split"
        )
    had_list, now_list = had_files.split("|"), files.split("|")
    # lmpipe before 2026-11-27 read a file reached twice (a link, a folder and a file in it) twice an epoch
    if had_split == split and set(had_list) == set(now_list) and len(had_list) > len(now_list):
        raise SettingsError(
            f"{path} was trained reading a file of --data more than once an epoch, which lmpipe now reads "
            "once: that checkpoint's record ids cannot be followed; start a new run"
        )
    raise SettingsError(
        f"{path} was trained on other --data ({_corpus_difference(had_list, now_list)}): resume with the same --data"
    )


def _corpus_difference(had: list[str], now: list[str], few: int = 3) -> str:
    """The files ("name:size") in one corpus and not the other, a few of each named: a changed object in a
    corpus of thousands reads as one line, not the two lists."""

    def named(items: list[str]) -> str:
        more = f" and {len(items) - few} more" if len(items) > few else ""
        return ", ".join(repr(i) for i in items[:few]) + more

    gone, new = [f for f in had if f not in set(now)], [f for f in now if f not in set(had)]
    out = [f"trained on, not in --data now: {named(gone)}"] if gone else []
    out += [f"in --data now, not trained on: {named(new)}"] if new else []
    return "; ".join(out) or "the same files in another order"


def check_not_read_back(flag: str, path: str | None, data: list[str]) -> None:
    """A file the run writes where a later run would read it as corpus (a .jsonl doc-log in a --data folder)
    would train on it, and change the corpus's fingerprint so that the run cannot resume."""
    from lmpipe.producer.formats import local_folder, read_from_dir

    if path and read_from_dir(Path(path).name):
        folder = Path(path).resolve().parent
        for d in data:
            if (given := local_folder(d)) is not None and given.resolve() == folder:  # file:// URLs too
                # `--data D`: the CLI names it `D (in LMPIPE_DATA)` where the variable gave it
                raise SettingsError(f"{flag} {path} is in the folder --data {d}, where a later run reads it "
                                    "as corpus; write it elsewhere")  # fmt: skip


def check_not_an_input(outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str]]) -> None:
    """No file the run writes (the doc-log, the summary) is one it reads (a corpus file, the tokenizer), nor
    are two of them one file: the summary was written over the corpus, the doc-log appended to it."""
    written: list[tuple[str, str]] = []
    for flag, path in outputs:
        if not path or not os.path.exists(path):
            continue
        for what, given in inputs + written:
            if os.path.exists(given) and os.path.samefile(path, given):
                raise SettingsError(f"{flag} {path} is {what} {given}: the run would write over it; "
                                    "write it elsewhere")  # fmt: skip
        written.append((f"the {flag}", path))


def say_left_out(data: list[str]) -> None:
    """One line for the files of --data's directories that are not read (by their names)."""
    from lmpipe.producer.formats import left_out

    if skipped := left_out(data):
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        log.info("--data: %d file(s) or folder(s) in its directories not read (not corpus files by name, "
                 "hidden, links to nothing, not regular files, or subfolders: a folder is read one level deep): %s%s",
                 len(skipped), ", ".join(skipped[:3]), more)  # fmt: skip


def say_no_effect(cfg: PipelineConfig, tcfg: TrainConfig | None = None) -> None:
    """One warning for each setting given that changes nothing, or less than it reads as changing."""
    if cfg.pad_multiple > 1 and cfg.strategy in ("pack", "pad"):
        log.warning("--pad-multiple %d has no effect with --strategy %s: every row is --seq-len wide; it rounds "
                    "the widths of pad-batch and bucket", cfg.pad_multiple, cfg.strategy)  # fmt: skip
    elif cfg.pad_multiple >= cfg.seq_len > 1 and cfg.strategy in ("pad-batch", "bucket"):
        log.warning("--pad-multiple %d is not below --seq-len %d: every batch is %d wide, as --strategy pad "
                    "makes them", cfg.pad_multiple, cfg.seq_len, cfg.seq_len)  # fmt: skip
    if tcfg is not None and not tcfg.consume_only and tcfg.steps and tcfg.warmup >= tcfg.steps:
        log.warning("--warmup %d is not below --steps %d: the learning rate never reaches --lr %g",
                    tcfg.warmup, tcfg.steps, tcfg.lr)  # fmt: skip


def first_document(corpus: Corpus, *, text: bool = False) -> Record:
    """The corpus's first good record (with text, if `text`): an empty corpus is a usage mistake."""
    first_bad = ""
    for rec in corpus.records():
        if rec.bad is None and (rec.text if text else True):
            return rec
        if rec.bad is not None and not first_bad:
            first_bad = f"; the first: {rec.where}: {rec.bad[1]}"  # the one line says what is wrong
    what = "text documents" if text else "documents"
    raise SettingsError(
        f"--data: no {what} in {corpus.describe()} (every record is empty or malformed{first_bad})"
    )


def check_writable(flag: str, path: str | None, *, directory: bool = False) -> None:
    """A place the run writes to only later (checkpoints, the summary, the doc-log) can be written: a
    mistake there is found now, not when the first checkpoint or the summary is due after hours of work."""
    if not path:
        return
    p = Path(path)
    if directory and p.exists() and not p.is_dir():
        raise SettingsError(f"{flag} {path}: exists and is not a directory")
    if not directory and p.is_dir():
        raise SettingsError(f"{flag} {path}: is a directory; name a file")
    # a checkpoint directory is made with its parents; a file needs its folder
    base = p if directory else p.parent
    while directory and not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise SettingsError(f"{flag} {path}: {base} is not an existing directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise SettingsError(f"{flag} {path}: {base} is not writable by this user")
    try:  # what access() cannot tell: /proc, /sys and the like refuse even root a new entry
        os.rmdir(tempfile.mkdtemp(prefix=".lmpipe-write-check-", dir=base))
    except OSError as exc:
        raise SettingsError(f"{flag} {path}: nothing can be made in {base} ({exc.strerror or exc})") from None


def check_device(name: str) -> None:
    kind, _, index = name.partition(":")
    if kind in ("auto", "cpu"):
        return
    import torch  # only here: `lmpipe run` forks its producers after these checks, best before torch loads

    if kind == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, kind)
        available = backend.is_available()
        count = backend.device_count() if available else 0
    if not available:
        raise SettingsError(f"--device {name}: torch sees no {kind} device here; use --device cpu or auto")
    if index and int(index) >= count:
        raise SettingsError(f"--device {name}: there are {count} {kind} device(s), numbered from 0")


# -- pieces of a run ----------------------------------------------------------------------------------


def stop_on_signals(trainer) -> None:
    def handler(signum, _frame):
        name = signal.Signals(signum).name
        log.info("%s: finishing the current step, then stopping", name)
        trainer.request_stop(name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def linger(seconds: float) -> None:
    """Sleep after the work, /metrics still served by its daemon thread; a signal cuts it short."""
    if seconds <= 0:
        return
    log.info("work done; serving metrics for %.0f s more", seconds)
    done = threading.Event()
    # the trainer's handlers only ask a finished run to stop: here a signal must end the wait itself
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait(seconds)


def report(summary, path: str | None) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\n")  # end the live status line
    print(summary.render(), flush=True)
    if path:
        with open(path, "w") as f:  # standard JSON: an unknown figure (NaN, a run with no step) is null
            json.dump(_no_nan(summary.to_dict()), f, indent=1, allow_nan=False)


def _no_nan(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _no_nan(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_no_nan(x) for x in v]
    return v


class LocalProducer:
    """A producer process forked by this launcher, with the parts of subprocess.Popen's interface the
    launcher uses (pid, poll, returncode, wait, terminate, kill)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode  # -N when a signal N ended it, as Popen's

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"producer {self.pid}", timeout or 0.0)
        return self.proc.exitcode

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


def _producer_main(cfg: PipelineConfig, opts: ProduceOptions, log_level: str) -> None:
    """A forked producer: what `lmpipe produce` does, with its errors as that command reports them."""
    from lmpipe.shared.log import setup

    setup(f"producer {opts.worker}", log_level)
    try:
        code = produce(cfg, opts)
    except (SettingsError, ValueError, OSError) as exc:
        log.error("%s", exc)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def fork_producers(
    cfg: PipelineConfig, metrics_base: int | None, linger_s: float, log_level: str
) -> list[LocalProducer]:
    """`lmpipe run`'s producers, forked from this process before it imports torch or starts a thread: they
    begin with lmpipe's modules and the tokenizer the checks loaded (a DataLoader worker's head start),
    where a new interpreter spends about 0.4 s importing and loading them. They connect to the trainer
    as any producer does, retrying until it listens."""
    from lmpipe.producer import manager  # noqa: F401  # imported once here, for every child

    ctx = multiprocessing.get_context("fork")
    # producers tokenize in threads, as when they were spawned; said outright, the tokenizers library does
    # not warn about the fork (this process never tokenizes before it)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    procs = []
    for i in range(cfg.producers):
        if metrics_base is None or metrics_base < 0:
            port = -1
        else:
            port = 0 if metrics_base == 0 else metrics_base + 1 + i
        opts = ProduceOptions(worker=i, metrics_port=port, metrics_linger=linger_s, exit_with_parent=True)
        proc = ctx.Process(target=_producer_main, args=(cfg, opts, log_level), name=f"lmpipe-producer-{i}")
        proc.start()
        procs.append(LocalProducer(proc))
    return procs


def reap(procs: list[LocalProducer], grace: float = 5.0) -> None:
    """Wait for producers that were told to stop; terminate, then kill, the ones that do not."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            log.warning("producer pid %d ignored SIGTERM; killing it", p.pid)
            p.kill()
            p.wait()


# -- the commands -------------------------------------------------------------------------------------


def train(
    cfg: PipelineConfig, tcfg: TrainConfig, opts: ReportOptions, *, local_producers: bool, log_level: str
) -> int:
    """`lmpipe train` (producers come from elsewhere) and `lmpipe run` (local_producers: started here)."""
    # under torchrun this process is rank r of R: it binds port + 2r, and its producers get that rank's
    # share, port and metrics ports (per_rank, which the trainer applies too)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world <= 1 and (cfg.world_size > 1 or cfg.rank > 0):  # it trained rank 0's share of the corpus alone
        raise SettingsError(
            f"--rank/--world-size {cfg.rank}/{cfg.world_size} name ranks of a torchrun job, and this trainer runs "
            f"without torchrun (one rank): start it with `torchrun --nproc-per-node {cfg.world_size} -m lmpipe "
            "...` and leave them out, or leave them out to train on the whole corpus here"
        )
    rank_cfg, rank_tcfg = per_rank(cfg, tcfg, rank, world) if world > 1 else (cfg, tcfg)
    check_ports(rank_cfg)
    if local_producers and rank_cfg.producers > rank_tcfg.shards:  # forked, each idle: thousands hung the run
        raise SettingsError(
            f"--producers {cfg.producers}: more than the {rank_tcfg.shards} shards the corpus is split into "
            "(--shards), and a producer without a shard only stands by; "
            + (
                f"give --shards {rank_cfg.producers} too, or fewer producers"
                if rank_cfg.producers <= 4096
                else "at most 4096 (as many as --shards can be)"
            )
        )
    if local_producers and (mp := rank_tcfg.metrics_port) and mp > 0 and mp + rank_cfg.producers > 65535:
        raise SettingsError(  # producer i serves its metrics on port + 1 + i: bind() failed in each of them
            f"--metrics-port {tcfg.metrics_port}: its {rank_cfg.producers} producers would serve on ports up to "
            f"{mp + rank_cfg.producers}, past 65535; give a lower --metrics-port (0: any free port, -1: off)"
        )
    check_keys(cfg, server=True)
    tok = check_tokenizer(cfg)
    if tcfg.vocab_size and tcfg.vocab_size < tok.vocab_size:  # the trainer checks too (after torch loads)
        raise SettingsError(
            f"--vocab-size {tcfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size}"
        )
    # the corpus producers must serve; "": the first producer's (`train` alone)
    data = data_content = data_versions = ""
    inputs = [("the --tokenizer", cfg.tokenizer)] if cfg.tokenizer and os.path.isfile(cfg.tokenizer) else []
    if local_producers or cfg.data:  # `lmpipe train --data X` trains on X, not on what a producer serves
        try:
            corpus = check_corpus(cfg, tok)
        except SettingsError as exc:
            if local_producers:
                raise
            raise SettingsError(
                f"{exc} (the trainer opens its --data to refuse producers of another corpus; where the corpus "
                "is only on the producers' hosts, leave --data off the trainer)"
            ) from None
        if tcfg.resume:
            check_resume_corpus(corpus, tcfg)
        data, data_content = corpus.fingerprint(), corpus.content_digest()
        data_versions = corpus.version_digest()
        inputs += [("the --data file", f.path) for f in corpus.paths if f.remote is None]
    check_device(tcfg.device)
    check_writable("--checkpoint-dir", tcfg.checkpoint_dir, directory=True)
    if tcfg.checkpoint_dir and (Path(tcfg.checkpoint_dir) / "header.json").is_file():
        raise SettingsError(
            f"--checkpoint-dir {tcfg.checkpoint_dir} is one checkpoint; give the folder that holds it "
            f"(--resume {tcfg.checkpoint_dir} resumes from this one)"
        )
    lock_checkpoint_dir(tcfg)
    check_not_overwritten(tcfg)
    if not tcfg.checkpoint_dir and (tcfg.resume or tcfg.checkpoint_every):  # worked on, then lost at the end
        given = f"--resume {tcfg.resume}" if tcfg.resume else f"--checkpoint-every {tcfg.checkpoint_every}"
        log.warning("%s without --checkpoint-dir: this run writes no checkpoint, and its steps are lost "
                    "when it ends; give --checkpoint-dir to keep them", given)  # fmt: skip
    check_writable("--doc-log", tcfg.doc_log)
    check_not_read_back("--doc-log", tcfg.doc_log, cfg.data)
    check_writable("--summary-json", opts.summary_json)
    check_not_an_input([("--doc-log", tcfg.doc_log), ("--summary-json", opts.summary_json)], inputs)
    say_no_effect(cfg, tcfg)
    if local_producers:
        say_left_out(cfg.data)
    if local_producers and not cfg.data:  # so that a run on the wrong corpus shows it at its start
        log.info(
            "data: the built-in corpus (%s generated documents); --data names yours", f"{cfg.builtin_docs:,}"
        )
    if local_producers and not tcfg.steps and not cfg.epochs:  # both documented; together they mean no end
        log.info("--steps 0 and --epochs 0: this run trains until it is stopped (Ctrl-C or SIGTERM)")
    procs: list[LocalProducer] = []
    if local_producers:  # forked now, before torch is imported (fork_producers says why)
        procs = fork_producers(rank_cfg, rank_tcfg.metrics_port, opts.metrics_linger, log_level)
    try:
        from lmpipe.consumer.report import print_status
        from lmpipe.consumer.trainer import Trainer

        trainer = Trainer(cfg, tcfg, data=data, data_content=data_content, data_versions=data_versions)
    except BaseException:
        for p in procs:
            p.kill()
        reap(procs)
        raise
    stop_on_signals(trainer)
    if procs:
        log.info("started %d producer process(es): pids %s", len(procs), " ".join(str(p.pid) for p in procs))

        def producers_alive() -> str | None:
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    return f"producer {i} exited with code {p.returncode}"
            return None

        trainer.health_check = producers_alive
    try:
        summary = trainer.run(progress=lambda step, st: print_status(step, st, tcfg.steps))
        if trainer.dist.is_main:  # under torchrun, rank 0 reports for the job
            report(summary, opts.summary_json)
        if not trainer.interrupted:
            linger(opts.metrics_linger)  # local producers linger as long, side by side
    finally:
        reap(procs)
    if any(p.returncode not in (0, -signal.SIGTERM) for p in procs):
        log.error("producer exit codes: %s", [p.returncode for p in procs])
        return 1
    # a scheduler or script must not take a run that stopped on a problem (--wait-timeout) for one that ended
    return 1 if trainer.failure else 0


def produce(cfg: PipelineConfig, opts: ProduceOptions) -> int:
    from lmpipe.producer.manager import Producer, ProducerOptions, install_signal_handlers

    if opts.worker >= cfg.producers:
        raise SettingsError(f"--worker {opts.worker} must be below --producers {cfg.producers}")
    say_no_effect(cfg)
    check_keys(cfg, server=False)
    check_corpus(cfg, check_tokenizer(cfg))
    p = Producer(
        cfg,
        ProducerOptions(
            worker=opts.worker, metrics_port=opts.metrics_port, exit_with_parent=opts.exit_with_parent
        ),
    )
    install_signal_handlers(p)
    code = p.run()
    if not p.interrupted:
        linger(opts.metrics_linger)
    return code
