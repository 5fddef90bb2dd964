"""`lmpipe plot`: loss, tokens/s and data wait over steps, from a run's --summary-json (its per-interval
history), as one picture. matplotlib is an extra (`pip install 'lmpipe[plot]'`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lmpipe.shared.settings import SettingsError

FIELDS = ("step", "loss", "tokens_per_second", "data_wait")


def read_history(path: Path) -> list[dict]:
    """The summary's per-interval rows, checked: one line naming the file and what is wrong otherwise."""
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
        if isinstance(row, dict) and row.get("loss", 0) is None:  # --summary-json writes a NaN loss as null
            row["loss"] = math.nan
        if not isinstance(row, dict) or not all(isinstance(row.get(k), int | float) for k in FIELDS):
            raise SettingsError(f"{path}: history[{i}] lacks a number for one of {', '.join(FIELDS)}")
    return rows


def plot(summary: Path, out: Path) -> int:
    """Write the picture; returns the number of intervals drawn."""
    rows = read_history(summary)
    try:
        import matplotlib
    except ImportError:
        raise SettingsError("lmpipe plot needs matplotlib: pip install 'lmpipe[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8), constrained_layout=True)
    loss, speed, wait = axes
    loss.plot(steps, [r["loss"] for r in rows], marker=".", color="tab:blue")
    loss.set_ylabel("training loss")
    if all(r["loss"] > 0 and math.isfinite(r["loss"]) for r in rows):
        loss.set_yscale("log")
    speed.plot(steps, [r["tokens_per_second"] for r in rows], marker=".", color="tab:green")
    speed.set_ylabel("tokens/s trained")
    speed.set_ylim(bottom=0)
    wait.plot(steps, [100 * r["data_wait"] for r in rows], marker=".", color="tab:red")
    wait.axhline(5, color="grey", linestyle="--", linewidth=1, label="5%: add producers above")
    wait.set_ylabel("data wait (% of time)")
    wait.set_ylim(bottom=0)
    wait.legend(loc="upper right")
    wait.set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"lmpipe run: {summary.name}")
    if out.is_dir():
        raise SettingsError(f"--out {out} is a directory; name the picture's file (run.png)")
    if not out.suffix:
        raise SettingsError(f"--out {out}: name the picture's file with its format (.png, .svg, .pdf)")
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:  # a missing folder, an unknown extension
        raise SettingsError(f"--out {out}: {exc}") from None
    finally:
        plt.close(fig)
    return len(rows)
