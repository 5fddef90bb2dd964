"""`--dry-run` of `lmpipe run`, `train` and `produce`: the resolved settings, each with where its value came
from, and what the command would start, after the checks a real start makes that need no peer. Nothing is
started, bound, forked or written (the ports are only tried, as a real start's check tries them).

What is printed is a TOML file (`seq_len = 256  # LMPIPE_SEQ_LEN`, the rest comments): a `--config` file.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from lmpipe.consumer.config import TrainConfig
from lmpipe.options import GlobalOptions, ProduceOptions, ReportOptions
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.settings import CONFIG, show, source_of, specs


def toml_value(v: Any) -> str:
    """A setting's value written as TOML (None has no TOML form: the caller comments the line out)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v) if v == v and v not in (float("inf"), float("-inf")) else f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def settings_lines(ns: argparse.Namespace, configs: list[Any]) -> list[str]:
    """One line per setting: `name = value  # where it came from`, in the order of the classes' fields."""
    out = []
    for cfg in configs:
        for spec in specs(type(cfg)):
            if spec.meta.hidden or spec.name == "dry_run":
                continue
            v, src = getattr(cfg, spec.name), source_of(ns, spec)
            line = f"# {spec.dest} = none" if v is None else f"{spec.dest} = {toml_value(v)}"
            if spec.dest == CONFIG and v is not None:  # a config file names no other: said, as a comment
                line = "# " + line
            out.append(f"{line:<44}  # {src}")
    return out


def _print(title: str, ns: argparse.Namespace, configs: list[Any], starts: list[str]) -> None:
    print(f"# {title}: a dry run; nothing was started")
    print(
        "\n# settings (value, and where it came from: a flag, an LMPIPE_ variable, a config file, the default)"
    )
    print("\n".join(settings_lines(ns, configs)))
    print("\n# would start")
    print("\n".join(f"#   {s}" for s in starts))


def _data(cfg: PipelineConfig) -> str:
    if cfg.mixture() is not None:
        return "the mixture of " + (f"--mix {show(cfg.mix)}" if cfg.mix else f"--mix-file {cfg.mix_file}")
    return show(cfg.data) if cfg.data else f"the built-in corpus ({cfg.builtin_docs:,} documents)"


def model_line(cfg: PipelineConfig, tcfg: TrainConfig) -> str:
    """The model and its parameter count, counted on the meta device (no memory, no device, no weights)."""
    if tcfg.consume_only:
        return "no model (--consume-only)"
    from lmpipe.consumer.config import MODELS

    if tcfg.model not in MODELS:
        return f"the Hugging Face model in {tcfg.model} (counted when built)"
    import torch

    from lmpipe.checks import check_tokenizer
    from lmpipe.consumer.model import GPT, preset

    vocab = max(tcfg.vocab_size, check_tokenizer(cfg).vocab_size)
    mcfg = preset(tcfg.model, vocab_size=vocab, block_size=cfg.seq_len)
    with torch.device("meta"):
        n = GPT(mcfg).num_params(non_embedding=False)
    return (
        f"model {tcfg.model}: {n:,} parameters ({mcfg.n_layer} layers, {mcfg.n_embd} wide, "
        f"vocabulary {mcfg.vocab_size:,}, --seq-len {cfg.seq_len})"
    )


def checkpoint_line(tcfg: TrainConfig) -> str:
    """Whether the run would start fresh or resume, and from which checkpoint (its header read, no tensor)."""
    from lmpipe.consumer.checkpoint import resolve_resume

    where = (
        f"checkpoints to {tcfg.checkpoint_dir} (at the end"
        + (f" and every {tcfg.checkpoint_every} steps" if tcfg.checkpoint_every else "")
        + f", keeping {tcfg.keep_checkpoints})"
        if tcfg.checkpoint_dir
        else "no checkpoints (no --checkpoint-dir)"
    )
    found = resolve_resume(tcfg.resume, tcfg.checkpoint_dir)
    if found is not None:
        return f"resume from {found}; {where}"
    if tcfg.resume == "auto":
        return f"start fresh (--resume auto: no checkpoint in {tcfg.checkpoint_dir} yet); {where}"
    return f"start fresh; {where}"


def dry_run_train(
    ns: argparse.Namespace,
    g: GlobalOptions,
    cfg: PipelineConfig,
    tcfg: TrainConfig,
    opts: ReportOptions,
    *,
    local_producers: bool,
) -> int:
    """`lmpipe run/train --dry-run`: launch.train's checks (the checkpoint folder neither made nor locked),
    then what it would start."""
    from lmpipe.checks import check_keys, say_left_out, say_no_effect
    from lmpipe.launch import check_inputs, check_outputs, rank_settings
    from lmpipe.shared.sockets import endpoints

    rank_cfg, rank_tcfg = rank_settings(cfg, tcfg, local_producers)
    check_keys(cfg, server=True)
    facts = check_inputs(cfg, tcfg, local_producers)
    check_outputs(cfg, tcfg, opts, facts.inputs, lock=False)
    say_no_effect(cfg, tcfg)
    if local_producers:
        say_left_out(cfg.all_data())
    ep = endpoints(rank_cfg)
    starts = []
    if local_producers:
        starts.append(f"{rank_cfg.producers} producer process(es) on {_data(cfg)}, --strategy {cfg.strategy}")
    else:
        starts.append("no producers: they connect from elsewhere (`lmpipe produce`)")
    starts.append(f"the trainer, bound to {ep.describe()}, control {ep.control}")
    mp = rank_tcfg.metrics_port
    if mp is None or mp < 0:
        starts.append("no /metrics (--metrics-port -1)")
    else:
        port = "any free port" if mp == 0 else f"port {mp}"
        more = f", producers {mp + 1}..{mp + rank_cfg.producers}" if local_producers and mp else ""
        starts.append(f"/metrics on {port}{more}")
    starts.append(model_line(cfg, tcfg))
    starts.append(f"--device {tcfg.device}, --precision {tcfg.precision}, " + (
        f"{tcfg.steps} steps" if tcfg.steps else "until the producers' epochs end"))  # fmt: skip
    starts.append(checkpoint_line(tcfg))
    if tcfg.eval_data and not tcfg.consume_only:
        from lmpipe.evaldata import describe, held_out

        starts.append(describe(held_out(cfg, tcfg), tcfg))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        starts.append(f"rank {rank_cfg.rank} of {rank_cfg.world_size} (torchrun)")
    _print(f"lmpipe {ns.cmd}", ns, [g, cfg, tcfg, opts], starts)
    return 0


def dry_run_produce(
    ns: argparse.Namespace, g: GlobalOptions, cfg: PipelineConfig, opts: ProduceOptions
) -> int:
    """`lmpipe produce --dry-run`: the producer's checks (corpus, tokenizer, keys), then where it would
    connect. The trainer is not asked: a dry run needs no peer."""
    from lmpipe.procs import check_produce
    from lmpipe.shared.sockets import endpoints

    corpora = check_produce(cfg, opts)
    ep = endpoints(cfg)
    who = "a producer" if opts.worker < 0 else f"producer {opts.worker}"
    mp = opts.metrics_port
    metrics = "no /metrics" if mp is None or mp < 0 else f"/metrics on {'any free port' if mp == 0 else mp}"
    starts = [
        f"{who}, connecting to the trainer at {ep.describe()}, control {ep.control}",
        f"on {corpora.describe()}, --strategy {cfg.strategy}, --seq-len {cfg.seq_len}",
        metrics,
    ]
    _print("lmpipe produce", ns, [g, cfg, opts], starts)
    return 0
