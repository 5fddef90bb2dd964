"""Settings of the lmpipe commands themselves: logging, reporting, the producer process, the one-shot
commands. Fields as in shared/settings.py; the pipeline's settings are in shared/config.py, the trainer's
in consumer/config.py."""

from __future__ import annotations

from dataclasses import dataclass

from lmpipe.shared.settings import at_least, between, inherit, setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level_problem(level: str) -> str | None:
    if level.upper() in LOG_LEVELS:
        return None
    return f"must be one of {', '.join(LOG_LEVELS)}"


@dataclass
class GlobalOptions:
    log_level: str = setting("INFO", check=log_level_problem, help="DEBUG, INFO, WARNING or ERROR")
    config: str | None = setting(
        None,
        metavar="FILE",
        help="a TOML file of settings, `seq_len = 256` (the names --dry-run prints); flags and LMPIPE_ "
        "variables win over it",
    )


@dataclass
class ReportOptions:
    """`lmpipe train` and `lmpipe run`: a dry run, and what happens once training ends."""

    dry_run: bool = setting(
        False,
        env=False,
        help="print the resolved settings (and where each came from) and what would start, run the checks "
        "that need no peer, and exit (0, or 2 with the refusal a real start would give); nothing starts",
    )

    summary_json: str | None = setting(None, metavar="FILE", help="write the end-of-run summary as JSON")
    metrics_linger: float = setting(
        0.0,
        check=at_least(0),
        metavar="SECONDS",
        help="keep /metrics up this long after the work is done, for a last scrape",
    )


@dataclass
class ProduceOptions:
    """One producer process (`lmpipe produce`)."""

    worker: int = setting(
        -1,
        check=at_least(-1),
        help="this producer's number in logs (`lmpipe run` numbers its producers 0..producers-1); -1: "
        "none. Either way the trainer decides which shards it serves, so `docker compose --scale "
        "producer=N` needs no per-replica settings",
    )
    metrics_port: int | None = setting(
        9401,
        check=between(-1, 65535),
        help="Prometheus /metrics port of this producer (0: any free port, -1: off)",
    )
    metrics_linger: float = inherit(ReportOptions, "metrics_linger")
    dry_run: bool = inherit(ReportOptions, "dry_run")
    exit_with_parent: bool = setting(
        False, hidden=True, env=False, help="quit when the process that started this one is gone"
    )


# One-shot commands take flags only (no LMPIPE_* variables): an --out meant for one must not reach another.


@dataclass
class TokenizerOptions:
    vocab_size: int = setting(
        4096,
        # above a few million the BPE trainer's tables no longer fit in memory (1e9 aborts the process)
        check=between(258, 1 << 22),
        help="train: vocabulary size (256 bytes, end-of-text, and the merges)",
    )
    out: str | None = setting(None, metavar="FILE", help="train: where to write tokenizer.json")
    builtin: bool = setting(False, help="train: rebuild the shipped built-in tokenizer")


@dataclass
class PrepareOptions:
    out: str | None = setting(None, required=True, metavar="DIR", help="shard directory to create")
    shard_tokens: int = setting(1 << 26, check=at_least(1), help="tokens per shard file")
    force: bool = setting(False, help="replace --out if it exists")


@dataclass
class KeysOptions:
    out: str | None = setting(None, required=True, metavar="DIR", help="directory for the key pairs")


@dataclass
class ExportOptions:
    out: str | None = setting(None, required=True, metavar="FILE", help="output .safetensors file")


@dataclass
class HealthOptions:
    """`lmpipe health`: a container health check that proves progress, not only a live process."""

    metrics_port: int = setting(
        9400, check=between(1, 65535), help="the /metrics port to read (on 127.0.0.1)"
    )
    stalled_after: float = setting(
        600.0,
        check=at_least(1),
        metavar="SECONDS",
        help="a trainer without a step for this long (since its last step, or its start) is unhealthy",
    )


@dataclass
class PlotOptions:
    out: str | None = setting(
        None, required=True, metavar="FILE", help="the picture to write (.png, .svg, .pdf)"
    )
    label: list[str] = setting(
        [], metavar="NAME", help="each summary file's name in the legend, in order (default: the file names)"
    )
