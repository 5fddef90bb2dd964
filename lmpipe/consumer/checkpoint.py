"""Checkpoints the trainer can resume from without losing or repeating a sample.

Layout: one directory per checkpoint, `<dir>/step-00000100/` holding
  header.json  format version, lmpipe version, model dims, vocabulary, tokenizer hash, batching settings,
               step, session, and the sha256 of state.pt
  state.pt     model, optimizer, loss scaler, step, RNG states and, per producer, the cursor and sequence
               number of the last batch trained on (loaded with torch.load(weights_only=True))
and `<dir>/latest`, a one-line pointer. A checkpoint is written into a temporary directory, fsynced and
renamed into place, then `latest` is replaced the same way: a crash at any moment leaves either the old
or the new checkpoint, never half of one. The header is read and compared before any tensor is loaded;
any mismatch is refused with the field named, and nothing on disk is touched. On CUDA the trainer hands
save() a snapshot in host memory and calls it from a background thread (consumer/checkpoint_async.py).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmpipe.consumer.checkpoint_io import BLOCK, HashingFile, blocks_sha256, save_state
from lmpipe.consumer.checkpoint_io import BUFFER as _BUFFER
from lmpipe.shared import __version__
from lmpipe.shared.config import MAX_LINE_BYTES
from lmpipe.shared.files import sha256_file

log = logging.getLogger("lmpipe.trainer")

# 2: state.pt's workers holds every data-parallel rank's cursors; 3: one cursor per shard (--shards,
# header "shards"), where 2 had one per producer (--producers, header stream.producers): the same split;
# 4: state.pt's checksum is a sha256 of its blocks' sha256s (header state_sha256_blocks, computed in parallel:
# consumer/checkpoint_io.py), where 3 and before have one of the whole file (state_sha256), still checked
FORMAT_VERSION = 4
_PREFIX = "step-"
_NAME = re.compile(r"step-(\d+)")
NO_MODEL = "none (--consume-only)"  # a checkpoint's model field when it holds producer cursors only


class CheckpointError(ValueError):
    """A checkpoint that must not be used; the message says which field or file and why."""


def check_trusted(path: Path) -> None:
    """CheckpointError unless `path` belongs to this user and only this user can write it: a checkpoint
    another local user could have planted or changed (its cursors moved ahead, its weights replaced) is
    never resumed. Root's checkpoints must be root's."""
    try:
        st = path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror})") from None
    if st.st_uid != os.geteuid():
        raise CheckpointError(
            f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): another user may have "
            "planted or changed it, so it is not resumed; copy the checkpoint into a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            f"{path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone there may have changed it, so it is not resumed; "
            f"`chmod go-w {path}` if you trust its contents"
        )


def check_checkpoint_trusted(path: Path, root: Path | None) -> None:
    """The checkpoint folder, its files and the folder holding it (where a planted step-N would go)."""
    for p in ([root] if root is not None else []) + [path, path / "header.json", path / "state.pt"]:
        if p.exists():
            check_trusted(p)


_PRIVATE_FILE = 0o644  # group and others may read (the umask may take more), never write


def _private_open(file: str | os.PathLike, flags: int) -> int:
    return os.open(file, flags, _PRIVATE_FILE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Loaded:
    path: Path
    header: dict[str, Any]
    state: dict[str, Any]


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.dir = Path(directory)
        self.keep = keep
        # the last write's parts: state.pt's bytes; seconds to serialize and write it (hashed meanwhile),
        # of that spent waiting for the hash, to fsync it; and the whole save (set by save)
        self.last_parts: dict[str, float] = {}

    # -- writing -------------------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        """The folder the checkpoint of `step` is (or will be, once written) renamed to."""
        return self.dir / f"{_PREFIX}{step:08d}"

    def save(self, step: int, header: dict[str, Any], state: dict[str, Any], how: str = "") -> Path:
        """Write atomically; returns the checkpoint's directory. `how`: said after the write time in the
        log line (a background write says how long the step loop waited for its snapshot)."""
        t0 = time.perf_counter()
        make_dir(self.dir)
        final = self.path(step)
        tmp = self.dir / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._write(tmp, step, header, state)
            _test_write_delay()
        # torch.save says a full disk as a RuntimeError ("unexpected pos ...")
        except (OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial write would hold the space a retry needs
            free = f"{shutil.disk_usage(self.dir).free / 2**20:,.0f} MiB"
            raise OSError(
                f"could not write checkpoint step {step} in {self.dir} ({free} free there): {exc}"
            ) from exc
        if final.exists():  # re-saving the same step (e.g. at SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = self.dir / f".latest.tmp-{os.getpid()}"
        with open(pointer, "w", opener=_private_open) as f:
            f.write(final.name + "\n")
        os.replace(pointer, self.dir / "latest")
        _fsync_dir(self.dir)
        self._prune(final)
        parts = self.last_parts
        parts["total"] = time.perf_counter() - t0
        log.info("checkpoint %s written in %.2f s (%.2f GiB: %.2f s to write, %.2f s to fsync)%s", final,
                 parts["total"], parts["bytes"] / 2**30, parts["serialize"], parts["fsync"], how and f"; {how}")  # fmt: skip
        return final

    def _write(self, tmp: Path, step: int, header: dict[str, Any], state: dict[str, Any]) -> None:
        """state.pt and header.json into `tmp`, fsynced; the parts' seconds into last_parts."""
        tmp.mkdir(mode=0o755)  # never writable by group or others, whatever the umask: resume checks it
        t0 = time.perf_counter()
        with open(tmp / "state.pt", "wb", buffering=_BUFFER, opener=_private_open) as f:
            out = HashingFile(f)
            try:
                save_state(state, out)
            finally:
                out.close()
            f.flush()
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        hdr = {
            **header,
            "format_version": FORMAT_VERSION,
            "lmpipe_version": __version__,
            "step": step,
            # of the bytes written, per block: the file is not read back
            "state_sha256_blocks": {"block_bytes": BLOCK, "sha256": out.digest()},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(tmp / "header.json", "w", opener=_private_open) as f:
            json.dump(hdr, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        self.last_parts = {"bytes": out.bytes, "serialize": t1 - t0, "fsync": t2 - t1,
                           "hash_wait": out.hash_wait}  # fmt: skip

    def _prune(self, written: Path) -> None:
        """Keep the `keep` newest writes, the one just written first. By write time, not step: a run resumed
        from an earlier step writes lower-numbered checkpoints than the ones it left behind."""
        others = sorted((p for p in self.list() if p != written), key=lambda p: p.stat().st_mtime_ns)
        for old in others[: max(0, len(others) - (self.keep - 1))] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for tmp in self.dir.glob(".*.tmp-*"):  # left by a writer that was killed
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------------------

    def list(self) -> list[Path]:
        """The checkpoints this manager wrote, by step: folders named step-<number> only (a user's renamed
        copy, step-20-good, or a step-best of their own is theirs, never resumed from or pruned)."""
        if not self.dir.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.dir.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
        return [p for _, p in sorted(found)]

    def latest_step(self) -> int | None:
        p = self.latest()
        return int(p.name[len(_PREFIX) :]) if p else None

    def latest(self) -> Path | None:
        """The checkpoint `latest` names, or, where it names none (missing, damaged, written over), the one
        of the highest step."""
        try:
            name = (self.dir / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if _NAME.fullmatch(name) and (self.dir / name / "header.json").is_file():
            return self.dir / name
        done = self.list()
        return done[-1] if done else None


# A test hook, never a setting: seconds to sleep after a checkpoint's files are written and fsynced in their
# temporary folder, before it is renamed into place, so that a test can kill the trainer while a
# (background) write is in flight (tests/e2e/test_checkpoint_async.py). Read here and nowhere else.
TEST_WRITE_DELAY = "LMPIPE_TEST_CHECKPOINT_WRITE_DELAY"


def _test_write_delay() -> None:
    if seconds := float(os.environ.get(TEST_WRITE_DELAY) or 0):
        time.sleep(seconds)


def make_dir(folder: Path) -> None:
    """A --checkpoint-dir, made where missing, never writable by group or others (a resume refuses that)."""
    if not folder.is_dir():
        folder.mkdir(mode=0o755, parents=True, exist_ok=True)


def read_header(path: Path) -> dict[str, Any]:
    f = path / "header.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no header.json; not an lmpipe checkpoint")
    try:
        hdr = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{f}: unreadable header ({exc})") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{f}: header is not a JSON object")
    version = hdr.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{f}: malformed header: format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{f}: format_version {version!r} is newer than this lmpipe ({__version__}) understands "
            f"(up to {FORMAT_VERSION}); upgrade lmpipe to resume it"
        )
    stream = hdr.get("stream")
    if version < 3 and isinstance(stream, dict) and "producers" in stream:
        # worker w of N producers read exactly what shard w of N shards reads: resumable with --shards N
        hdr["shards"] = stream.pop("producers")
    if isinstance(stream, dict):  # written before the header kept it: the run had the default, most likely
        stream.setdefault("max_line_bytes", MAX_LINE_BYTES)
    return hdr


def order_fields(stream: Any, data: str) -> Any:
    """The stream settings that decide which batches a corpus makes. The built-in corpus and shards are read
    by index and shuffled whole or not at all (producer/stream.py): there only whether --shuffle-window is
    above 1 counts, and --doc-split and --max-line-bytes, which shape text files' documents, not at all."""
    if not isinstance(stream, dict) or not data.startswith(("builtin:", "shards:")):
        return stream
    out = {k: v for k, v in stream.items() if k not in ("doc_split", "max_line_bytes")}
    if isinstance(out.get("shuffle_window"), int):
        out["shuffle_window"] = "whole epoch" if out["shuffle_window"] > 1 else "none"
    return out


def compare(header: dict[str, Any], expected: dict[str, Any], where: Path) -> None:
    """Refuse a checkpoint whose model, tokenizer or batching differs from this run's."""
    problems = []
    for key, want in expected.items():
        have = header.get(key)
        if key == "stream":  # the checkpoint's corpus is this run's (the producers check it)
            have, want = (order_fields(s, str(header.get("data") or "")) for s in (have, want))
        if (
            key == "model"
            and isinstance(want, dict)
            and isinstance(have, dict)
            and ((kind := _architecture(have)) != (here := _architecture(want)))
        ):  # another architecture: its name, not every field of two configs
            problems.append(f"model: checkpoint has {kind}, this run has {here}")
        elif isinstance(want, dict) and isinstance(have, dict):
            for sub in sorted(set(want) | set(have)):
                if key == "stream" and sub == "epochs" and more_epochs(have.get(sub), want.get(sub)):
                    continue  # the shards go on into the next epoch: their cursors stay valid
                if key == "stream" and sub == "world_size":
                    continue  # another number of ranks shares the run's shards anew (consumer/reshard.py)
                if want.get(sub) != have.get(sub):
                    problems.append(
                        f"{key}.{sub}: checkpoint has {have.get(sub)!r}, this run has {want.get(sub)!r}"
                    )
        elif have != want:
            problems.append(f"{key}: checkpoint has {have!r}, this run has {want!r}")
    if problems:
        raise CheckpointError(
            f"{where} does not match this run: " + "; ".join(problems) + _remedy(header, problems)
        )


def _architecture(model: dict[str, Any]) -> str:
    """A checkpoint's model, by kind: a Hugging Face config's model_type (--model DIR), or lmpipe's GPT."""
    return f"a Hugging Face {model['model_type']!r} model" if "model_type" in model else "lmpipe's GPT"


def more_epochs(old: Any, new: Any) -> bool:
    """Whether --epochs `new` goes on past a checkpoint's `old`: more of them, or 0 (until stopped). An
    epoch's order depends only on the seed and the epoch's number (producer/stream.py), so the cursors of
    the epochs before stay valid; fewer epochs could leave a cursor past the new end."""
    return isinstance(old, int) and isinstance(new, int) and old > 0 and (new == 0 or new > old)


def _remedy(header: dict[str, Any], problems: list[str]) -> str:
    """What to do about a refused checkpoint: resume with its settings, or start a new run."""
    fresh = "start a new run (another --checkpoint-dir, or no --resume)"
    stream = header.get("stream")
    if any(p.startswith("stream.epochs:") for p in problems) and isinstance(stream, dict):
        # fewer epochs than the checkpoint's: its shards' cursors may be past the new end
        if not stream.get("epochs"):  # it trained until stopped: its cursors may be in any epoch
            return f": resume with --epochs 0 (until stopped); to train a number of epochs, {fresh}"
        return f": resume with --epochs {stream.get('epochs')} or more (0: until stopped); to train fewer, {fresh}"
    return ""


STATE_KEYS = ("model", "optimizer", "step", "workers", "rng")  # what a resume reads from state.pt


def _checksum_matches(state_file: Path, header: dict[str, Any]) -> bool:
    """state.pt against the header's sha256: of the whole file (state_sha256: format 3 and before, or a header
    a user re-hashed by hand), else of each block (state_sha256_blocks: format 4)."""
    if "state_sha256" in header:
        return sha256_file(state_file) == header["state_sha256"]
    blocks = header.get("state_sha256_blocks")
    if not isinstance(blocks, dict):
        return False
    size = blocks.get("block_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return False
    return blocks_sha256(state_file, size) == blocks.get("sha256")


def _read_state(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    state_file = path / "state.pt"
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: missing")
    if not _checksum_matches(state_file, header):
        raise CheckpointError(f"{state_file}: checksum mismatch (truncated or corrupt file)")
    import torch

    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{state_file}: cannot be loaded: torch.load(weights_only=True) refuses it (not a trainer state)"
        ) from None
    except Exception as exc:  # one line: some torch errors run over several
        why = (str(exc).splitlines() or [""])[0]
        raise CheckpointError(f"{state_file}: cannot be loaded ({type(exc).__name__}: {why})") from None
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise CheckpointError(f"{state_file}: not an lmpipe trainer state (no {', '.join(missing)})")
    return state


class ReadAhead:
    """state.pt read (checksum, then torch.load) on a thread of its own from the moment the checkpoint to
    resume is known, while the model is built: on a GPU machine, 1-2 s of a restart's start.
    Its result, or what went wrong, is taken by load(); nothing is trusted before load() compared the header."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path, self.header = path, header
        self._state: dict[str, Any] | None = None
        self._error: BaseException | None = None
        # a daemon: a start refused before load() exits without waiting for the read
        self._thread = threading.Thread(target=self._read, name="checkpoint-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._state = _read_state(self.path, self.header)
        except BaseException as exc:  # raised where load() takes it, as a read there would have raised it
            self._error = exc

    def state(self) -> dict[str, Any]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._state is not None
        return self._state


def load(path: Path, expected: dict[str, Any], ahead: ReadAhead | None = None) -> Loaded:
    """Read and check a checkpoint (`ahead`: the read already under way, of this path's header); raises
    CheckpointError, never returns something half-valid."""
    if ahead is not None and ahead.path != path:
        ahead = None  # another checkpoint's read: this one is read here
    header = ahead.header if ahead is not None else read_header(path)
    compare(header, expected, path)
    return Loaded(path, header, ahead.state() if ahead is not None else _read_state(path, header))


def resolve_resume(arg: str | None, directory: str | None) -> Path | None:
    """--resume auto: the latest checkpoint in --checkpoint-dir, or None for a fresh start.
    --resume PATH: that checkpoint directory (or the latest inside a checkpoint root)."""
    if not arg:
        return None
    if arg == "auto":
        if not directory:
            raise CheckpointError("--resume auto needs --checkpoint-dir")
        found = CheckpointManager(directory).latest()
        if found is not None:
            check_checkpoint_trusted(found, Path(directory))
        return found
    p = Path(arg)
    if (p / "header.json").is_file():
        check_checkpoint_trusted(p, None)
        return p
    found = CheckpointManager(p).latest()
    if found is None:
        raise CheckpointError(f"--resume {arg}: no checkpoint there")
    check_checkpoint_trusted(found, p)
    return found


def export_safetensors(path: Path, out: Path) -> dict[str, Any]:
    """Write the model weights of a checkpoint as safetensors (tied weights stored once)."""
    from safetensors.torch import save_file

    header = read_header(path)
    if header.get("model") == NO_MODEL:
        raise CheckpointError(
            f"{path}: a --consume-only checkpoint: no model to export (producer cursors only)"
        )
    state = _read_state(path, header)
    model = header.get("model", {})
    meta = {
        "model": json.dumps(model),
        "tokenizer": str(header.get("tokenizer", "")),
        "step": str(header.get("step", state["step"])),
    }
    if isinstance(model, dict) and "model_type" in model:
        # a Hugging Face model (--model DIR): under its own names, each tied weight once, as save_pretrained
        # writes them: beside the run's config.json as model.safetensors, from_pretrained loads it
        weights: dict[str, Any] = {}
        seen: set[int] = set()
        for k, v in state["model"].items():
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                weights[k.removeprefix("model.")] = v.contiguous()
        meta["format"] = "pt"  # transformers' loader asks for it
    else:
        weights = {k: v.contiguous() for k, v in state["model"].items()}
        # lm_head and wte share storage; safetensors refuses aliases, and loaders re-tie them
        weights.pop("transformer.wte.weight", None)
    # written beside `out`, then renamed over it: a failed export (a full disk) leaves the file that was there
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(weights, str(tmp), metadata=meta)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return meta
