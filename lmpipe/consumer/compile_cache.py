"""--compile's cache for restarts, kept beside the checkpoints: what torch.compile built (dynamo's, AOTAutograd's
and inductor's artifacts, the Triton kernels bundled in them, autotuning results) as one file that torch
serializes (torch.compiler.save_cache_artifacts), and lmpipe's own kernel plans (consumer/fast/cublaslt.py's
GEMM algorithm picks), with a manifest: the key it was made for and each file's checksum.

A restart (Slurm requeue, preemption, a crash loop; on this host or another that sees the checkpoints) loads
it before the first step, and torch finds its compiled graphs instead of compiling them again. torch's own
local cache (the temp folder's torchinductor_<user>) is left as it is: a second run on the same host finds
its graphs there too; this cache is what survives a host change.

Never trusted blindly: a cache made for another key (another torch, CUDA, Triton, GPU, lmpipe, model or a
compile-relevant setting) is not used, and a file that does not match its checksum (a torn write, a change)
is not loaded; either is said in one line and rebuilt after the first step. `--compile-cache off` keeps none.

    cache = CompileCache(folder, key, writer=True)
    cache.open()     # one line: warm, cold, or why it is rebuilt; loads torch's artifacts when warm
    ...              # the first step compiles (from the loaded artifacts when warm)
    cache.save()     # after the first step, and again at the end if more graphs were compiled
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from lmpipe.shared import __version__

log = logging.getLogger("lmpipe.trainer")

FORMAT = 1
MANIFEST = "manifest.json"
ARTIFACTS = "torch-compile.bin"  # torch.compiler.save_cache_artifacts()'s bytes
PLANS = "cublaslt-plans.json"  # consumer/fast/cublaslt.py's algorithm picks (CUDA)
FOLDER = "compile-cache"  # under --checkpoint-dir (--compile-cache auto)

# the cache's states, as the start line and the summary say them
OFF, COLD, WARM, REBUILT = "off", "cold", "warm", "rebuilt"


def place(compile_cache: str, checkpoint_dir: str | None) -> Path | None:
    """Where the cache lives: --compile-cache DIR, or auto: beside --checkpoint-dir's checkpoints; None: off."""
    if compile_cache == "off":
        return None
    if compile_cache == "auto":
        return Path(checkpoint_dir) / FOLDER if checkpoint_dir else None
    return Path(compile_cache)


def environment(device: torch.device) -> dict[str, Any]:
    """What every compiled artifact depends on outside lmpipe's settings: the software and the card."""
    env: dict[str, Any] = {"lmpipe": __version__, "torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda or "",
            triton=_triton(),
        )
    return env


def _triton() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def differences(made: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The key's fields that differ, as `NAME A (this run: B)`, in the key's order."""
    out = []
    for name in dict.fromkeys([*here, *made]):
        if made.get(name) != here.get(name):
            out.append(f"{name} {_show(made.get(name))} (this run: {_show(here.get(name))})")
    return out


def _show(v: Any) -> str:
    return "none" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


class CompileCache:
    """One cache folder for one key. `writer`: this process writes it (rank 0 under torchrun; the others
    only read). Every problem with the folder is one line and a cold start, never a failed run."""

    def __init__(self, folder: Path | None, key: dict[str, Any], *, writer: bool = True):
        self.folder, self.writer = folder, writer
        self.key = json.loads(json.dumps(key))  # as a manifest reads it back (tuples are lists)
        self.state = OFF if folder is None else COLD
        self.reason = ""  # why it was rebuilt, or where it was found
        self.plans: dict[str, Any] = {}  # the cuBLASLt picks read from the cache (consumer/fast/cublaslt.py)
        self.saved_graphs = -1  # graphs compiled when it was last saved; -1: not saved by this run
        self._write_failed = False

    # -- reading ---------------------------------------------------------------------------------------

    def open(self) -> str:
        """Check the folder against this run's key and checksums; when all hold, load torch's artifacts (and
        the cuBLASLt plans). Logs and returns one line saying whether the cache is warm, and if not why."""
        if self.folder is None:
            return self._say("compile cache: off (--compile-cache off, or no --checkpoint-dir to keep it in; "
                             "torch's own local cache still serves this host)")  # fmt: skip
        problem = self._check()
        if problem is None:
            problem = self._load()
        if problem is None:
            self.state = WARM
            return self._say(f"compile cache: warm ({self.folder}: {self.reason})")
        if problem == "":
            return self._say(f"compile cache: cold (none yet in {self.folder}; written after the first step)")
        self.state, self.reason = REBUILT, problem
        if self.writer:
            self._remove()
        line = f"compile cache {self.folder}: {problem}; not trusted, rebuilt after the first step"
        log.warning("%s", line)
        return line

    def _say(self, line: str) -> str:
        log.info("%s", line)
        return line

    def _check(self) -> str | None:
        """None: the folder holds a cache made for this key whose files match their checksums; "": it holds
        none; else what is wrong with it."""
        assert self.folder is not None
        manifest = self.folder / MANIFEST
        if not manifest.exists():
            return ""
        try:
            m = json.loads(manifest.read_text())
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("key"), dict)
                or not isinstance(m.get("files"), dict)
            ):
                raise ValueError("not a manifest")
        except (OSError, ValueError) as exc:
            return f"its {MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
        if m.get("format") != FORMAT:
            return f"its format is {m.get('format')!r}, this lmpipe reads {FORMAT}"
        if diff := differences(m["key"], self.key):
            more = f", and {len(diff) - 1} more" if len(diff) > 1 else ""
            return f"made for {diff[0]}{more}"
        if ARTIFACTS not in m["files"]:
            return f"its manifest names no {ARTIFACTS}"
        for name, digest in m["files"].items():
            path = self.folder / str(name)
            if "/" in str(name) or not path.is_file():
                return f"{name} is missing"
            try:
                if file_digest(path) != digest:
                    return f"{name} does not match its checksum (a torn write, or changed since)"
            except OSError as exc:
                return f"{name} is unreadable ({exc.strerror or exc})"
        self.reason = f"{m.get('graphs', '?')} graph(s), saved at {m.get('saved_at', '?')}"
        return None

    def _load(self) -> str | None:
        assert self.folder is not None
        try:
            data = (self.folder / ARTIFACTS).read_bytes()
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as exc:  # torch's own format changed, or bytes it cannot parse: rebuilt
            return f"torch could not load {ARTIFACTS} ({type(exc).__name__}: {exc})"
        if info is None:  # torch said why in a warning of its own
            return f"torch found nothing it could load in {ARTIFACTS}"
        plans = self.folder / PLANS
        if plans.is_file():
            try:
                loaded = json.loads(plans.read_text())
                self.plans = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError) as exc:
                return f"its {PLANS} is unreadable ({type(exc).__name__}: {exc})"
        return None

    # -- writing ---------------------------------------------------------------------------------------

    def save(self, graphs: int, plans: dict[str, Any] | None = None, step: int = 0) -> bool:
        """Write what torch compiled in this process so far (and `plans`), with the manifest; True if written.
        Skipped when the cache is off, this process does not write it, a warm cache holds these graphs
        already, or nothing was compiled."""
        if self.folder is None or not self.writer or self._write_failed:
            return False
        if self.state == WARM and self.saved_graphs < 0:
            self.saved_graphs = graphs  # the first step's graphs, loaded from the cache: nothing new yet
            return False
        if graphs <= max(self.saved_graphs, 0):
            return False
        got = torch.compiler.save_cache_artifacts()
        if got is None or not got[0]:
            return False
        try:
            self._write(got[0], graphs, plans or {}, step)
        except OSError as exc:  # a full or read-only disk: the run goes on, the next start is cold
            self._write_failed = True
            log.warning("compile cache %s: cannot write it (%s); this run goes on without it",
                        self.folder, exc.strerror or exc)  # fmt: skip
            return False
        self.saved_graphs = graphs
        log.info("compile cache: %d graph(s) saved in %s (%.1f MB)", graphs, self.folder, len(got[0]) / 1e6)
        return True

    def _write(self, data: bytes, graphs: int, plans: dict[str, Any], step: int) -> None:
        import datetime as dt

        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        files = {ARTIFACTS: _write_atomic(self.folder / ARTIFACTS, data)}
        if plans:
            files[PLANS] = _write_atomic(self.folder / PLANS, json.dumps(plans, sort_keys=True).encode())
        manifest = {
            "format": FORMAT,
            "key": self.key,
            "files": files,
            "graphs": graphs,
            "saved_at": f"step {step}, " + dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        }
        # last: until it is replaced, the old manifest's checksums refuse the new files (rebuilt, not trusted)
        _write_atomic(self.folder / MANIFEST, json.dumps(manifest, indent=1).encode())

    def _remove(self) -> None:
        assert self.folder is not None
        for name in (MANIFEST, ARTIFACTS, PLANS):
            with contextlib.suppress(OSError):  # a folder it cannot write: the save says so
                (self.folder / name).unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes) -> str:
    """Write `data` to `path` through a temporary file and a rename; its sha256."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return hashlib.sha256(data).hexdigest()
