"""`lmpipe plot`: one or several runs' --summary-json files on one figure: training loss (and the held-out
eval loss where the run had --eval-data), learning rate, tokens/s and data wait over steps, one colour per
run, each run's legend entry carrying its summary's numbers. Axes are labelled with plain numbers (3, 4, 6,
0.003, 12,000), never `6×10^0`. matplotlib is an extra (`pip install 'lmpipe[plot]'`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmpipe.shared.settings import SettingsError

FIELDS = ("step", "loss", "tokens_per_second", "data_wait")


@dataclass
class Run:
    label: str
    summary: dict
    rows: list[dict]  # the per-interval history, checked
    evals: list[dict]  # step, eval_loss of each evaluation (none without --eval-data)


def _number(v: Any) -> float:
    """A summary's figure as a float: --summary-json writes NaN (no value) as null."""
    return math.nan if v is None else float(v)


def read_summary(path: Path) -> tuple[dict, list[dict]]:
    """The summary and its per-interval rows, checked: one line naming the file and what is wrong otherwise."""
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such file (write one with --summary-json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SettingsError(f"{path}: not a summary written by --summary-json ({exc})") from None
    rows = summary.get("history") if isinstance(summary, dict) else None
    if not isinstance(rows, list) or not rows:
        raise SettingsError(
            f"{path}: no per-interval history (a run shorter than --log-every, or a summary of an older lmpipe)"
        )
    for i, row in enumerate(rows):
        if isinstance(row, dict):
            for k in ("loss", "lr"):
                if k in row and row[k] is None:
                    row[k] = math.nan
        if not isinstance(row, dict) or not all(isinstance(row.get(k), int | float) for k in FIELDS):
            raise SettingsError(f"{path}: history[{i}] lacks a number for one of {', '.join(FIELDS)}")
    assert isinstance(summary, dict)
    return summary, rows


def read_history(path: Path) -> list[dict]:
    return read_summary(path)[1]


def read_runs(paths: list[Path], labels: list[str]) -> list[Run]:
    """Each file's run, labelled by --label (one per file) or by its file name (its path where names clash)."""
    if labels and len(labels) != len(paths):
        raise SettingsError(
            f"--label: {len(labels)} label(s) for {len(paths)} summary file(s); give one per file, in order"
        )
    names = [p.name for p in paths]
    default = [str(p) if names.count(p.name) > 1 else p.stem for p in paths]
    runs = []
    for path, label in zip(paths, labels or default, strict=True):
        summary, rows = read_summary(path)
        evals = [
            {"step": e["step"], "eval_loss": _number(e.get("eval_loss"))}
            for e in summary.get("evals") or []
            if isinstance(e, dict) and isinstance(e.get("step"), int | float)
        ]
        runs.append(Run(label, summary, rows, evals))
    return runs


def numbers(run: Run) -> str:
    """The summary's headline numbers, for the run's legend entry."""
    s = run.summary
    parts = [f"{s.get('steps', run.rows[-1]['step'])} steps"]
    if math.isfinite(last := _number(s.get("last_loss"))):
        parts.append(f"loss {last:.3f}")
    if run.evals and math.isfinite(run.evals[-1]["eval_loss"]):
        parts.append(f"eval {run.evals[-1]['eval_loss']:.3f}")
    if math.isfinite(tps := _number(s.get("steady_tokens_per_second"))):
        parts.append(f"{tps:,.0f} tok/s steady")
    if math.isfinite(wait := _number(s.get("data_wait_fraction"))):
        parts.append(f"data wait {100 * wait:.1f}%")
    return f"{run.label}: " + ", ".join(parts)


def plain(v: float, _pos: Any = None) -> str:
    """A tick label as a plain number: 3, 0.5, 0.003, 12,000 (no 10^k, no offset)."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else ""
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}" if abs(v) >= 1e-4 else f"{v:.0e}"


def figure(runs: list[Run]) -> Any:
    """The matplotlib figure (2 x 2 panels) of `runs`."""
    try:
        import matplotlib
    except ImportError:
        raise SettingsError("lmpipe plot needs matplotlib: pip install 'lmpipe[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, grid = plt.subplots(2, 2, sharex=True, figsize=(12, 8), constrained_layout=True)
    loss, lr, speed, wait = grid.flat
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c, steps = colours[i % len(colours)], [r["step"] for r in run.rows]
        loss.plot(steps, [r["loss"] for r in run.rows], marker=".", color=c, label=numbers(run))
        if run.evals:
            loss.plot([e["step"] for e in run.evals], [e["eval_loss"] for e in run.evals], marker="o",
                      linestyle="--", color=c, label=f"{run.label}: eval loss (held out)")  # fmt: skip
        if any("lr" in r for r in run.rows):
            lr.plot(steps, [r.get("lr", math.nan) for r in run.rows], marker=".", color=c)
        speed.plot(steps, [r["tokens_per_second"] for r in run.rows], marker=".", color=c)
        wait.plot(steps, [100 * r["data_wait"] for r in run.rows], marker=".", color=c)
    values = [r["loss"] for run in runs for r in run.rows] + [
        e["eval_loss"] for run in runs for e in run.evals
    ]
    if values and all(v > 0 and math.isfinite(v) for v in values):
        loss.set_yscale("log")  # plain labels below: 3, 4, 6, not 6×10^0
    loss.set_ylabel("loss (solid: training; dashed: held-out eval)")
    lr.set_ylabel("learning rate")
    speed.set_ylabel("tokens/s trained")
    wait.set_ylabel("data wait (% of time)")
    wait.axhline(5, color="grey", linestyle="--", linewidth=1, label="5%: add producers above")
    wait.legend(loc="upper right")
    for ax in (lr, speed, wait):
        ax.set_ylim(bottom=0)
    for ax in grid.flat:
        ax.yaxis.set_major_formatter(FuncFormatter(plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(plain) if ax is loss else NullFormatter())
        ax.xaxis.set_major_formatter(FuncFormatter(plain))
        ax.grid(True, alpha=0.3)
    for ax in (speed, wait):
        ax.set_xlabel("step")
    fig.legend(*loss.get_legend_handles_labels(), loc="outside lower center", ncols=1, fontsize="small")
    title = runs[0].label if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(f"lmpipe: {title}")
    return fig


def plot(summaries: list[Path], out: Path, labels: list[str] | None = None) -> list[Run]:
    """Write the picture of the runs; returns them (their rows are the intervals drawn)."""
    runs = read_runs(summaries, labels or [])
    if out.is_dir():
        raise SettingsError(f"--out {out} is a directory; name the picture's file (run.png)")
    if not out.suffix:
        raise SettingsError(f"--out {out}: name the picture's file with its format (.png, .svg, .pdf)")
    fig = figure(runs)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:  # a missing folder, an unknown extension
        raise SettingsError(f"--out {out}: {exc}") from None
    finally:
        plt.close(fig)
    return runs
