"""The pipeline settings both sides must agree on, their command-line flags, and the handshake fingerprint.

Every flag can also come from an environment variable (`LMPIPE_<FLAG>`, e.g. LMPIPE_STRATEGY=bucket), which
is how docker-compose configures the services. Flags win over the environment.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

STRATEGIES = ("pad", "pad-batch", "bucket", "pack")
DEFAULT_PORT = 5555


@dataclass
class PipelineConfig:
    data: list[str] = field(default_factory=list)  # empty: the built-in corpus
    tokenizer: str | None = None  # None: the built-in tokenizer
    strategy: str = "pack"
    seq_len: int = 128
    batch_size: int = 16
    bucket_k: int = 16
    bucket_window: int = 4096
    pad_multiple: int = 1
    seed: int = 0
    shuffle_window: int = 1000
    doc_split: str = "blank"
    builtin_docs: int = 20_000
    epochs: int = 0  # 0: loop over the corpus until the trainer stops
    producers: int = 2
    rank: int = 0  # trainer rank this pipeline feeds, of world_size data-parallel ranks
    world_size: int = 1
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    trusted_network: bool = False
    curve_dir: str | None = None  # ZeroMQ CURVE keys (lmpipe keys); encrypts and authenticates producers
    max_line_bytes: int = 1 << 20

    @property
    def data_addr(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def control_addr(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    def stream_fields(self) -> dict[str, Any]:
        """Everything that decides which batches a worker makes, in what order: cursors are only
        meaningful while these stay the same."""
        d = asdict(self)
        for k in ("data", "tokenizer", "host", "port", "trusted_network", "curve_dir", "max_line_bytes"):
            d.pop(k)
        return d


def fingerprint(cfg: PipelineConfig, tokenizer_hash: str, vocab_size: int, data: str = "") -> dict[str, Any]:
    return {"tokenizer": tokenizer_hash, "vocab_size": vocab_size, "data": data, **cfg.stream_fields()}


def mismatches(expected: dict[str, Any], got: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """Human-readable differences, e.g. "strategy: producer has 'pad', trainer has 'pack'"."""
    out = []
    for key in sorted(set(expected) | set(got)):
        if key in skip:
            continue
        if expected.get(key) != got.get(key):
            out.append(f"{key}: producer has {got.get(key)!r}, trainer has {expected.get(key)!r}")
    return out


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def _env(name: str, default: Any) -> Any:
    raw = os.environ.get(f"LMPIPE_{name.upper().replace('-', '_')}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, list):
        return raw.split()
    return raw


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    d = PipelineConfig()
    g = p.add_argument_group("data and batching (must match between producers and trainer)")
    g.add_argument(
        "--data",
        nargs="*",
        default=_env("data", []),
        metavar="PATH",
        help="text/JSONL files, directories of them, or a prepared shard directory; none: built-in corpus",
    )
    g.add_argument(
        "--tokenizer",
        default=_env("tokenizer", None),
        metavar="FILE",
        help="Hugging Face tokenizer.json (default: the built-in BPE)",
    )
    g.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=_env("strategy", d.strategy),
        help="how documents become fixed-shape batches (default: %(default)s)",
    )
    g.add_argument(
        "--seq-len", type=int, default=_env("seq_len", d.seq_len), help="row length T (default: %(default)s)"
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=_env("batch_size", d.batch_size),
        help="rows per batch (one micro-batch) (default: %(default)s)",
    )
    g.add_argument(
        "--bucket-k",
        type=int,
        default=_env("bucket_k", d.bucket_k),
        help="bucket: longest - shortest row in a batch <= k (default: %(default)s)",
    )
    g.add_argument(
        "--bucket-window",
        type=int,
        default=_env("bucket_window", d.bucket_window),
        help="bucket: document pieces indexed together (default: %(default)s)",
    )
    g.add_argument(
        "--pad-multiple",
        type=int,
        default=_env("pad_multiple", d.pad_multiple),
        help="pad-batch/bucket: round widths up to a multiple (bounded shapes for --compile)",
    )
    g.add_argument(
        "--seed", type=int, default=_env("seed", d.seed), help="shuffle seed (default: %(default)s)"
    )
    g.add_argument(
        "--shuffle-window",
        type=int,
        default=_env("shuffle_window", d.shuffle_window),
        help="documents shuffled together in streamed text/JSONL; 0 or 1 keeps corpus order",
    )
    g.add_argument(
        "--doc-split",
        choices=("blank", "heading"),
        default=_env("doc_split", d.doc_split),
        help="plain text: a document per blank-line block, or per ' = Heading = ' article",
    )
    g.add_argument(
        "--builtin-docs",
        type=int,
        default=_env("builtin_docs", d.builtin_docs),
        help="size of the built-in corpus (default: %(default)s)",
    )
    g.add_argument(
        "--epochs",
        type=int,
        default=_env("epochs", d.epochs),
        help="passes over the corpus; 0 = until the trainer stops (default: %(default)s)",
    )
    g.add_argument(
        "--producers",
        type=int,
        default=_env("producers", d.producers),
        help="number of producer workers the corpus is split across (default: %(default)s)",
    )
    g.add_argument(
        "--rank",
        type=int,
        default=_env("rank", d.rank),
        help="data-parallel rank this pipeline feeds (default: 0)",
    )
    g.add_argument(
        "--world-size",
        type=int,
        default=_env("world_size", d.world_size),
        help="data-parallel ranks; each rank's producers get a disjoint share of the corpus (default: 1)",
    )
    g.add_argument(
        "--max-line-bytes",
        type=int,
        default=_env("max_line_bytes", d.max_line_bytes),
        help="longer corpus lines are skipped and counted (default: %(default)s)",
    )
    n = p.add_argument_group("network")
    n.add_argument(
        "--host",
        default=_env("host", d.host),
        help="trainer address: the trainer binds it, producers connect to it (default: %(default)s)",
    )
    n.add_argument(
        "--port",
        type=int,
        default=_env("port", d.port),
        help="data port; the control channel uses port+1 (default: %(default)s)",
    )
    n.add_argument(
        "--trusted-network",
        action="store_true",
        default=_env("trusted_network", False),
        help="allow the trainer to bind a non-loopback address (traffic is not encrypted)",
    )
    n.add_argument(
        "--curve-dir",
        default=_env("curve_dir", None),
        metavar="DIR",
        help="ZeroMQ CURVE keys from `lmpipe keys`: encrypted traffic, only authorized producers get in",
    )


def pipeline_from_args(ns: argparse.Namespace) -> PipelineConfig:
    cfg = PipelineConfig(
        data=list(ns.data or []),
        tokenizer=ns.tokenizer,
        strategy=ns.strategy,
        seq_len=ns.seq_len,
        batch_size=ns.batch_size,
        bucket_k=ns.bucket_k,
        bucket_window=ns.bucket_window,
        pad_multiple=ns.pad_multiple,
        seed=ns.seed,
        shuffle_window=ns.shuffle_window,
        doc_split=ns.doc_split,
        builtin_docs=ns.builtin_docs,
        epochs=ns.epochs,
        producers=ns.producers,
        rank=ns.rank,
        world_size=ns.world_size,
        host=ns.host,
        port=ns.port,
        trusted_network=ns.trusted_network,
        curve_dir=ns.curve_dir,
        max_line_bytes=ns.max_line_bytes,
    )
    validate(cfg)
    return cfg


def validate(cfg: PipelineConfig) -> None:
    problems = []
    if not 2 <= cfg.seq_len <= 65535:
        problems.append(f"--seq-len must be in 2..65535, got {cfg.seq_len}")
    if cfg.batch_size < 1:
        problems.append(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if not 0 <= cfg.rank < cfg.world_size:
        problems.append(f"--rank must be in 0..--world-size-1, got rank {cfg.rank} of {cfg.world_size}")
    if cfg.producers < 1:
        problems.append(f"--producers must be >= 1, got {cfg.producers}")
    if cfg.bucket_k < 0 or cfg.bucket_window < 1 or cfg.pad_multiple < 1:
        problems.append("--bucket-k must be >= 0, --bucket-window and --pad-multiple >= 1")
    if cfg.epochs < 0:
        problems.append(f"--epochs must be >= 0, got {cfg.epochs}")
    if not 1 <= cfg.port <= 65534:
        problems.append(f"--port must be in 1..65534 (port+1 is the control channel), got {cfg.port}")
    if problems:
        raise ValueError("; ".join(problems))


def pipeline_argv(cfg: PipelineConfig) -> list[str]:
    """The flags that reproduce `cfg` (how `lmpipe run` starts its producer processes)."""
    argv = ["--data", *cfg.data] if cfg.data else []
    if cfg.tokenizer:
        argv += ["--tokenizer", cfg.tokenizer]
    for key, val in asdict(cfg).items():
        if key in ("data", "tokenizer") or val is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(val, bool):
            argv += [flag] if val else []
        else:
            argv += [flag, str(val)]
    return argv
