"""The pipeline settings both sides must agree on, and the handshake fingerprint.

Each field is one setting (shared/settings.py): its default, help and check make the `--flag` and the
`LMPIPE_<FLAG>` variable (e.g. LMPIPE_STRATEGY=bucket), which is how docker-compose configures the
services. Flags win over the environment.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any

from lmpipe.shared.mix import Mix, load_mix_file, parse_mix
from lmpipe.shared.settings import at_least, between, existing_dir, from_args, setting, to_argv, validate
from lmpipe.shared.wire import STRATEGIES

# One wire batch's tokens at most: its buffers (about 23 bytes a token, shared/batch.py) stay within what a
# socket buffer option (a C int) and a pinned slot can hold. Larger optimizer steps come from --accum.
MAX_BATCH_TOKENS = 1 << 24

DEFAULT_PORT = 5555
DOC_SPLITS = ("blank", "heading", "line")
BATCHING = "data and batching (must match between producers and trainer)"
NETWORK = "network"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


def mix_problem(items: list[str]) -> str | None:
    try:
        parse_mix(items)
    except ValueError as exc:
        return str(exc).removeprefix("--mix ")
    return None


def mix_file_problem(path: str) -> str | None:
    try:
        load_mix_file(path)
    except ValueError as exc:
        return str(exc).removeprefix(f"--mix-file {path}: ")
    return None


def host_problem(host: str) -> str | None:
    """A bindable/connectable address: an IP address, a host name, or '*' (every interface)."""
    if host == "*":
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(host) <= 253 and _HOSTNAME.fullmatch(host) and not re.fullmatch(r"[\d.]+", host):
        return None
    return "not an IP address or host name"


MAX_LINE_BYTES = 1 << 20  # longer corpus lines are skipped (and counted)


@dataclass
class PipelineConfig:
    data: list[str] = setting(
        [],
        metavar="PATH",
        help="corpus files (text, JSONL, .gz/.zst, Parquet, Arrow), directories or fsspec URLs (s3://...) of "
        "them, or a prepared shard directory; none: the built-in corpus (see README, Corpora)",
    )
    mix: list[str] = setting(
        [],
        metavar="NAME=SOURCE:WEIGHT",
        check=lambda v: mix_problem(v) if v else None,
        help="a mixture of named, weighted sources instead of --data, e.g. web=data/web/:0.7 "
        "code='s3://b/code/*.parquet':0.3; SOURCE is anything --data takes, weights need not sum to 1 "
        "(docs/mixtures.md)",
    )
    mix_file: str | None = setting(
        None,
        metavar="FILE",
        check=mix_file_problem,
        help="a mixture in a TOML file: sources with their data, weight and epochs, and a schedule of "
        "weights over steps (docs/mixtures.md)",
    )
    tokenizer: str | None = setting(
        None, metavar="FILE", help="Hugging Face tokenizer.json (none: the built-in BPE)"
    )
    strategy: str = setting("pack", choices=STRATEGIES, help="how documents become fixed-shape batches")
    seq_len: int = setting(128, check=between(2, 65535), help="row length T")
    batch_size: int = setting(16, check=at_least(1), help="rows per batch (one micro-batch)")
    bucket_k: int = setting(16, check=at_least(0), help="bucket: longest - shortest row in a batch <= k")
    bucket_window: int = setting(4096, check=at_least(1), help="bucket: document pieces indexed together")
    pad_multiple: int = setting(
        1,
        check=at_least(1),
        help="pad-batch/bucket: round widths up to a multiple (bounded shapes for --compile)",
    )
    seed: int = setting(0, check=at_least(0), help="shuffle seed (and the built-in corpus's)")
    shuffle_window: int = setting(
        1000,
        check=at_least(0),
        help="documents shuffled together in streamed text/JSONL; 0 or 1 keeps corpus order",
    )
    doc_split: str = setting(
        "blank",
        choices=DOC_SPLITS,
        help="plain text: a document per blank-line block, per ' = Heading = ' article, or per line",
    )
    text_column: str = setting(
        "text",
        metavar="NAME",
        help="Parquet, Arrow and Hugging Face datasets: the column holding each document; JSON Lines: the key",
    )
    builtin_docs: int = setting(
        20_000,
        check=between(1, 100_000_000),
        help="size of the built-in corpus (a demo: your --data for more)",
    )
    epochs: int = setting(
        0,
        check=at_least(0),
        help="passes over the corpus (a mixture: over each source without epochs of its own); 0: until the "
        "trainer stops",
    )
    producers: int = setting(
        2,
        check=at_least(1),
        help="producer processes `lmpipe run` starts, at most --shards (the trainer splits the corpus into "
        "--shards, whatever number of producers connect)",
    )
    rank: int = setting(0, check=at_least(0), help="data-parallel rank this pipeline feeds, of --world-size")
    world_size: int = setting(
        1,
        check=at_least(1),
        help="data-parallel ranks; each rank's producers get a disjoint share of the corpus",
    )
    host: str = setting(
        "127.0.0.1",
        group=NETWORK,
        check=host_problem,
        help="trainer address: the trainer binds it, producers connect to it",
    )
    port: int = setting(
        DEFAULT_PORT,
        group=NETWORK,
        check=between(1, 65534),
        help="data port; the control channel uses port+1",
    )
    trusted_network: bool = setting(
        False,
        group=NETWORK,
        help="plain TCP without keys: lets the trainer bind, and producers connect to, a non-loopback address "
        "(anyone who reaches the ports is trusted; traffic is not encrypted)",
    )
    curve_dir: str | None = setting(
        None,
        group=NETWORK,
        metavar="DIR",
        check=existing_dir,
        help="ZeroMQ CURVE keys from `lmpipe keys`: encrypted traffic, only authorized producers get in",
    )
    runtime_dir: str | None = setting(
        None,
        group=NETWORK,
        metavar="DIR",
        help="loopback --host without keys: the private (0700) directory of the trainer's Unix sockets "
        "(none: $XDG_RUNTIME_DIR/lmpipe, else /tmp/lmpipe-<uid>; see shared/sockets.py)",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        group=NETWORK,
        metavar="ADDR",
        check=host_problem,
        help="address /metrics listens on; 0.0.0.0 lets Prometheus on other hosts or containers scrape it",
    )
    max_line_bytes: int = setting(
        MAX_LINE_BYTES, check=at_least(1), help="longer corpus lines are skipped and counted"
    )

    def __post_init__(self) -> None:
        validate(self)

    def cross_check(self) -> list[str]:
        out = []
        data = " ".join(self.data)  # `--data X`: the CLI names LMPIPE_DATA where the variable gave it
        if self.mix and self.data:
            out.append(f"--mix and --data {data} exclude each other: a mixture names each source's data")
        if self.mix and self.mix_file:
            out.append(f"--mix and --mix-file {self.mix_file} exclude each other: give the mixture one way")
        if self.mix_file and self.data:
            out.append(f"--mix-file and --data {data} exclude each other: the file names each source's data")
        if self.rank >= self.world_size:
            out.append(f"--rank {self.rank} must be below --world-size {self.world_size}")
        if self.batch_size * self.seq_len > MAX_BATCH_TOKENS:
            out.append(
                f"--batch-size {self.batch_size} x --seq-len {self.seq_len} is {self.batch_size * self.seq_len:,} "
                f"tokens a batch, more than {MAX_BATCH_TOKENS:,}; --accum N makes a step of N batches"
            )
        return out

    def stream_fields(self) -> dict[str, Any]:
        """Everything that decides which batches a shard makes, in what order: cursors are only
        meaningful while these stay the same. (The number of shards is the trainer's --shards; the
        number of producers decides nothing. --max-line-bytes decides which lines a text document keeps.)"""
        d = asdict(self)
        for k in (
            "data", "tokenizer", "host", "port", "trusted_network", "curve_dir", "runtime_dir", "metrics_host",
            "producers", "mix", "mix_file",
        ):  # fmt: skip
            d.pop(k)
        mix = self.mixture()
        if mix is not None:  # the sources' names and epochs; not the weights (the trainer's, may change)
            d["mix"] = mix.fingerprint()
        return d

    def all_data(self) -> list[str]:
        """Every --data item the run reads: --data's, or each source's of the mixture, in order."""
        mix = self.mixture()
        return list(self.data) if mix is None else [d for s in mix.sources for d in s.data]

    def mixture(self) -> Mix | None:
        """The mixture --mix or --mix-file gives (sources without epochs of their own take --epochs); None
        without one: the run reads --data as before."""
        if self.mix:
            return parse_mix(self.mix, epochs=self.epochs)
        if self.mix_file:
            return load_mix_file(self.mix_file, epochs=self.epochs)
        return None


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


def pipeline_from_args(ns: argparse.Namespace) -> PipelineConfig:
    return from_args(ns, PipelineConfig)


def pipeline_argv(cfg: PipelineConfig) -> list[str]:
    """The flags that reproduce `cfg` (how `lmpipe run` starts its producer processes)."""
    return to_argv(cfg)
