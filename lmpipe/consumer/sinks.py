"""`--log-to`: the run's scalars also to TensorBoard or Weights & Biases, as optional extras, off by default.

- `tensorboard:DIR`: event files in DIR (`tensorboard --logdir DIR`), through torch's SummaryWriter, which
  needs the tensorboard package (pip install 'lmpipe[tensorboard]');
- `wandb` or `wandb:PROJECT`: a W&B run (project "lmpipe" by default) in offline mode unless WANDB_MODE says
  otherwise: nothing leaves the machine until `wandb sync` (pip install 'lmpipe[wandb]').

What goes there: at each logging interval the log line's figures (train/loss, train/lr, train/grad_norm,
train/tokens_per_second, train/data_wait, train/loss_scale, train/mfu), at each evaluation eval/loss; the
step is the optimizer step. Rank 0 writes for the job. A missing package is one line before anything starts.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from typing import Any

log = logging.getLogger("lmpipe.trainer")

KINDS = ("tensorboard", "wandb")
# the interval figures each sink gets, under train/ (RunStats.report's dict)
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_second", "data_wait", "loss_scale", "mfu")
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def sink_problem(spec: str) -> str | None:
    """What is wrong with one --log-to value (the setting's check), or None."""
    kind, sep, arg = spec.partition(":")
    if kind not in KINDS:
        return f"{spec!r}: choose tensorboard:DIR, wandb or wandb:PROJECT"
    if kind == "tensorboard" and not arg:
        return "tensorboard needs the folder for its event files: tensorboard:DIR"
    if kind == "wandb" and sep and not arg:
        return "wandb:PROJECT needs a project name (or plain wandb: the project lmpipe)"
    return None


def missing_package(specs: list[str]) -> str | None:
    """The one line saying which --log-to needs a package this install lacks (None: all there)."""
    for spec in specs:
        kind = spec.partition(":")[0]
        if importlib.util.find_spec(_PACKAGE[kind]) is None:
            return (
                f"--log-to {spec}: the {_PACKAGE[kind]} package is not installed (an optional extra): "
                f"pip install 'lmpipe[{kind}]', or leave --log-to {kind} out"
            )
    return None


class Sinks:
    """The --log-to destinations of this process (none where not rank 0)."""

    def __init__(self, specs: list[str], config: dict[str, Any], is_main: bool = True):
        self._writers: list[tuple[str, Any]] = []
        if not is_main:
            return
        for spec in specs:
            kind, _, arg = spec.partition(":")
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self._writers.append((kind, SummaryWriter(log_dir=arg)))
            else:
                wandb = importlib.import_module("wandb")  # an optional extra, no stubs
                mode = os.environ.get("WANDB_MODE") or "offline"  # online only where the user asks for it
                self._writers.append((kind, wandb.init(project=arg or "lmpipe", config=config, mode=mode)))
            offline = kind == "wandb" and mode == "offline"
            log.info("--log-to %s%s", spec, " (offline: `wandb sync` uploads it)" if offline else "")

    def __bool__(self) -> bool:
        return bool(self._writers)

    def interval(self, step: int, stats: dict[str, Any]) -> None:
        self.log(step, {f"train/{k}": stats[k] for k in TRAIN_KEYS if k in stats})

    def log(self, step: int, values: dict[str, float]) -> None:
        values = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}
        for kind, w in self._writers:
            try:
                if kind == "tensorboard":
                    for k, v in values.items():
                        w.add_scalar(k, v, step)
                else:
                    w.log(values, step=step)
            except Exception as exc:  # a full disk under an event file: said, training goes on
                log.warning("--log-to %s: could not write step %d (%s)", kind, step, exc)

    def close(self) -> None:
        for kind, w in self._writers:
            try:
                w.close() if kind == "tensorboard" else w.finish()
            except Exception as exc:
                log.warning("--log-to %s: could not close (%s)", kind, exc)
        self._writers = []


NO_SINKS = Sinks([], {})  # a trainer's before start()
