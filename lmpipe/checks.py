"""Checks before anything is built: what `lmpipe train`, `run` and `produce` can cheaply find wrong (ports,
keys, tokenizer, corpus, device, the places the run writes) is one line before a model is built or a
process started. Each raises SettingsError; the CLI prints it and exits 2."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.messages import version_location
from lmpipe.shared.settings import SettingsError

if TYPE_CHECKING:
    from lmpipe.consumer.config import TrainConfig  # the trainer's: not imported by producers
    from lmpipe.producer.corpora import Corpora
    from lmpipe.producer.sources import Corpus, Record
    from lmpipe.shared.tokenizer import TokenizerInfo

log = logging.getLogger("lmpipe")


def check_ports(cfg: PipelineConfig) -> None:
    """The trainer's data and control ports are free: on Unix sockets, no trainer holds the port's lock in
    a private runtime directory; on TCP, a plain bind on --host works, as ZeroMQ's will."""
    from lmpipe.shared.sockets import endpoints

    try:
        ep = endpoints(cfg)
        if ep.kind == "ipc":
            assert ep.runtime_dir is not None
            lock = ep.runtime_dir / f"{cfg.port}.lock"
            existed = lock.exists()
            ep.check_free(cfg.port)
            if not existed:  # made by the check: a start that fails later must not leave it behind
                _remove_unheld(lock)
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


def _remove_unheld(lock: Path) -> None:
    """Remove a trainer's lock file that no trainer holds (one that does keeps it)."""
    import fcntl

    try:
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.unlink()  # while held: a trainer starting this instant is refused, as if this one held it
    except OSError:
        pass  # held by a trainer that started meanwhile, or gone


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
        return load_tokenizer(cfg.tokenizer, cfg.all_data())
    except (OSError, ValueError) as exc:
        raise SettingsError(f"--tokenizer: {exc}") from None


def open_corpus(cfg: PipelineConfig, vocab_size: int | None = None) -> Corpus:
    from lmpipe.producer.sources import Corpus

    try:
        return Corpus.of(cfg, vocab_size)
    except OSError as exc:
        raise SettingsError(f"--data: {exc}") from None


def check_corpus(cfg: PipelineConfig, tok: TokenizerInfo) -> Corpora:
    """The corpus opens, has a document, and, if it is prepared shards, was made with this tokenizer: a
    mistake is one line now, not a producer that stops after the trainer has started. A mixture: each
    source's data, the line naming the source."""
    from lmpipe.producer.corpora import Corpora, source_config
    from lmpipe.producer.shards import check_prepared_with

    mix = cfg.mixture()
    if mix is None:
        corpus = open_corpus(cfg, tok.vocab_size)
        if corpus.shards is not None:
            check_prepared_with(corpus.shards, tok)
        first_document(corpus)
        return Corpora(cfg, tok.vocab_size, corpora=[corpus])
    flag = "--mix" if cfg.mix else f"--mix-file {cfg.mix_file}"
    opened = []
    for s in mix.sources:
        try:
            corpus = open_corpus(source_config(cfg, s.data), tok.vocab_size)
            if corpus.shards is not None:
                check_prepared_with(corpus.shards, tok)
            first_document(corpus)
        except (SettingsError, OSError, ValueError) as exc:
            raise SettingsError(f"{flag}: source {s.name!r}: {str(exc).removeprefix('--data: ')}") from None
        opened.append(corpus)
    return Corpora(cfg, tok.vocab_size, mix, corpora=opened)


_LOCKS: list[int] = []  # the checkpoint folders' lock files this process holds, until it exits


def lock_checkpoint_dir(tcfg: TrainConfig) -> None:
    """One run writes a --checkpoint-dir at a time: two wrote step-N over each other's, and one's clean-up
    removed the other's half-written checkpoint. A POSIX lock on DIR/.lock, held until this process exits
    (the producers it forks do not inherit it); under torchrun rank 0 takes it, the rank that writes."""
    if not tcfg.checkpoint_dir or int(os.environ.get("RANK", "0")) != 0:
        return
    import fcntl

    from lmpipe.consumer.checkpoint import make_dir  # torch-free

    folder = Path(tcfg.checkpoint_dir)
    make_dir(folder)
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


def check_resume_corpus(corpus: Corpus | Corpora, tcfg: TrainConfig) -> None:
    """A checkpoint resumes on the corpus it was trained on: said now, in one line, not by the producers'
    refusal after the model is built (consumer/checkpoint.py reads headers without torch). A mixture's:
    the same sources, each on the files it was trained on (the weights may change)."""
    from lmpipe.consumer.checkpoint import CheckpointError, read_header, resolve_resume
    from lmpipe.producer.corpora import Corpora

    try:
        path = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
        header = read_header(path) if path is not None else {}
    except CheckpointError:
        return  # the trainer names what is wrong with the checkpoint itself
    corpora = corpus if isinstance(corpus, Corpora) else None
    had = header.get("data")
    trained_mix = _mixture_data(had)
    if corpora is None or corpora.mix is None:
        one = corpus if corpora is None else corpora.corpora[0]
        assert not isinstance(one, Corpora)
        if trained_mix is not None:
            raise SettingsError(f"{path} was trained on a mixture ({', '.join(trained_mix)}): resume it with "
                                "the same --mix or --mix-file")  # fmt: skip
        _check_files(path, header, had, one.fingerprint(), one, "--data")
        _check_contents(path, header, one, "--data files" if had else "")
        return
    names = list(corpora.mix.names())
    if trained_mix is None and had:
        raise SettingsError(f"{path} was trained without a mixture (on --data): a mixture cannot resume it; "
                            "resume with its --data, or start a new run")  # fmt: skip
    if trained_mix is not None and list(trained_mix) != names:
        raise SettingsError(f"{path} was trained on the sources {', '.join(trained_mix)}, this run names "
                            f"{', '.join(names)}: resume with the same sources in the same order (their "
                            "weights may change)")  # fmt: skip
    now = json.loads(corpora.fingerprint())
    for i, name in enumerate(names):
        was = trained_mix.get(name) if trained_mix is not None else None
        _check_files(path, header, was, now[name], corpora.corpora[i], f"data in source {name!r}")
    _check_contents(path, header, corpora, "files" if had else "")


def _mixture_data(had: object) -> dict[str, str] | None:
    """A checkpoint's `data` as a mixture's (corpora.py: a JSON map of source to files), else None."""
    if not isinstance(had, str) or not had.startswith("{"):
        return None
    try:
        parts = json.loads(had)
    except ValueError:
        return None
    return parts if isinstance(parts, dict) else None


def _check_files(path: object, header: dict, had: object, now: str, corpus: Corpus, who: str) -> None:
    """The same files (names and sizes), read the same way, as the checkpoint's `had`."""
    stream = header.get("stream")
    had_lines = stream.get("max_line_bytes") if isinstance(stream, dict) else None
    if had and had == now and not corpus.random_access and had_lines not in (None, corpus.max_line_bytes):
        raise SettingsError(  # it decides which lines a document keeps: the cursors would point elsewhere
            f"{path} was trained with --max-line-bytes {had_lines}, this run has --max-line-bytes "
            f"{corpus.max_line_bytes}: resume with the same --max-line-bytes"
        )
    if not had or had == now:
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
            f"{path} was trained reading a file of {who} more than once an epoch, which lmpipe now reads "
            "once: that checkpoint's record ids cannot be followed; start a new run"
        )
    raise SettingsError(
        f"{path} was trained on other {who} ({_corpus_difference(had_list, now_list, who)}): resume with the "
        f"same {who}"
    )


def _check_contents(path: object, header: dict, corpus: Corpus | Corpora, files: str) -> None:
    """The same contents, and the same versions of remote objects, where the checkpoint says them ("": not
    checked). `files`: what the message calls the files ("": the checkpoint named no data)."""
    had_content, content = str(header.get("data_content") or ""), corpus.content_digest()
    had_versions = header.get("data_versions")
    versions = corpus.version_digest()
    pinned = (
        {version_location(str(v)): str(v) for v in had_versions} if isinstance(had_versions, list) else {}
    )
    other_content = bool(had_content and content and had_content != content)
    other_versions = bool(versions) and pinned.get(version_location(versions), versions) != versions
    if files and (other_content or other_versions):
        what = "their contents" if other_content else "their versions in the store"
        # which objects, where the checkpoint kept each one's version (Corpus.object_versions)
        kept = header.get("data_objects")
        objs = kept.get(version_location(versions)) if isinstance(kept, dict) else None
        changed = corpus.rewritten(objs) if not other_content else []
        named = f" (rewritten: {_named(changed)})" if changed else ""
        raise SettingsError(
            f"{path} was trained on {files} of the same names and sizes, but {what} changed "
            f"since it was written{named}: its cursors would not follow; resume with the files it was "
            "trained on, or start a new run"
        )


def _named(items: list[str], few: int = 3) -> str:
    """A few items named, the rest counted: a change in a corpus of thousands of files reads as one line."""
    more = f" and {len(items) - few} more" if len(items) > few else ""
    return ", ".join(repr(i) for i in items[:few]) + more


def _corpus_difference(had: list[str], now: list[str], who: str = "--data") -> str:
    """The files ("name:size") in one corpus and not the other, a few of each named: a changed object in a
    corpus of thousands reads as one line, not the two lists."""
    had_set, now_set = set(had), set(now)  # once: a corpus may hold thousands of files
    gone, new = [f for f in had if f not in now_set], [f for f in now if f not in had_set]
    where = who if who == "--data" else "it"
    out = [f"trained on, not in {where} now: {_named(gone)}"] if gone else []
    out += [f"in {where} now, not trained on: {_named(new)}"] if new else []
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


def check_model_folder(cfg: PipelineConfig, tcfg: TrainConfig, tokenizer_vocab: int) -> None:
    """--model DIR (a Hugging Face model folder): transformers installed, a config.json lmpipe can build
    without the folder's own code, a vocabulary that holds the tokenizer's ids and positions for --seq-len;
    read without torch or transformers (the trainer checks again with them)."""
    from lmpipe.consumer.config import MODELS
    from lmpipe.consumer.hf_folder import folder_problem, is_folder

    if tcfg.consume_only or not is_folder(tcfg.model, MODELS):
        return
    if why := folder_problem(tcfg.model, max(tcfg.vocab_size, tokenizer_vocab), cfg.seq_len):
        raise SettingsError(why)
