"""The trainer's live line on a real terminal (tmux, 80 columns): one line that never wraps into a trail,
every process's log lines printed above it, an ETA that holds steady over a steady run, and a terminal left
clean by Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, free_port_pair, lmpipe_env

# `lmpipe` with each step slowed by a fixed sleep, so that its pace is steady on a busy machine
PACED = (
    "import sys, time; import lmpipe.launch as L; d = float(sys.argv.pop(1)); run = L.run_trainer\n"
    "def paced(*a, **k):\n"
    "    import lmpipe.consumer.trainer as T; f = T.lr_at\n"
    "    T.lr_at = lambda s, c: (time.sleep(d), f(s, c))[1]\n"
    "    return run(*a, **k)\n"
    "L.run_trainer = paced; from lmpipe.cli import main; sys.exit(main())"
)
STEPS = 100
STATUS = re.compile(rf"^step (\d+)/{STEPS}\b")
LOGLINE = re.compile(r"\d\d:\d\d:\d\d \[(trainer|producer \d)\] ")


class Tmux:
    def __init__(self, tmp):
        self.sock = f"lmpipe-test-{os.getpid()}-{time.monotonic_ns()}"
        self.tmp = tmp

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True, check=True,
                              env=lmpipe_env(), cwd=REPO, timeout=30).stdout  # fmt: skip

    def screen(self) -> tuple[list[str], int]:
        """The visible lines and the cursor's line, in one tmux command (nothing is drawn in between)."""
        out = self("display", "-p", "-t", "live", "#{cursor_y}", ";", "capture-pane", "-p", "-t", "live")
        cursor, _, text = out.partition("\n")
        return text.split("\n"), int(cursor)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: it is the test's terminal")
def test_the_live_line_on_an_80_column_terminal(tmp_path):
    tmux = Tmux(tmp_path)
    (tmp_path / "paced.py").write_text(PACED)
    cmd = [sys.executable, str(tmp_path / "paced.py"), "0.12", "run", "--consume-only", "--steps", str(STEPS), "--seq-len", "32",
           "--batch-size", "2", "--builtin-docs", "300", "--port", str(free_port_pair()), "--metrics-port", "-1",
           "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "40"]  # fmt: skip
    # this checkout's lmpipe, not the one beside the script
    (tmp_path / "run.sh").write_text(
        f"PYTHONPATH={shlex.quote(str(REPO))} {shlex.join(cmd)}\necho EXIT=$?\nsleep 60\n"
    )
    tmux("new-session", "-d", "-s", "live", "-x", "80", "-y", "40", f"bash {tmp_path / 'run.sh'}")
    try:
        etas: list[tuple[float, int, float]] = []  # (when, step, seconds left)
        deadline = time.monotonic() + 300
        step, seen = 0, []
        while step < STEPS - 20:
            assert time.monotonic() < deadline, "\n".join(tmux.screen()[0])
            lines, cursor = tmux.screen()
            now = time.monotonic()
            status = [i for i, ln in enumerate(lines) if STATUS.match(ln)]
            text = "\n".join(lines)
            assert "EXIT=" not in text, text
            if not status:
                time.sleep(0.5)
                continue
            # one line, where the cursor is, within 80 columns; no piece of an earlier one anywhere
            assert status == [cursor] and len(lines[cursor]) < 80, text
            assert not any(("tok/s" in ln or "ETA " in ln) for ln in lines[:cursor]), text
            step = int(STATUS.match(lines[cursor]).group(1))  # type: ignore[union-attr]
            seen.append(step)
            if m := re.search(r"ETA (?:(\d+)m)?(\d+)s$", lines[cursor]):
                etas.append((now, step, 60 * int(m.group(1) or 0) + int(m.group(2))))
            time.sleep(0.7)
        tmux("send-keys", "-t", "live", "C-c")
        while "EXIT=" not in (text := "\n".join(tmux.screen()[0])):
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        every = tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "live")
        cursor_shown = tmux("display", "-p", "-t", "live", "#{cursor_flag}").strip()
    finally:
        subprocess.run(["tmux", "-L", tmux.sock, "kill-server"], capture_output=True, timeout=30)
    assert "EXIT=0" in every, every
    assert seen[0] < 10, f"drawn from the start, not at the first logging interval: {seen}"
    # the ETA at a steady pace: the end it predicts moves by less than 20% of the time left
    steady = [(t, s, left) for t, s, left in etas if s >= 10]
    assert len(steady) >= 5, etas
    ends = [t + left for t, _, left in steady]
    assert max(ends) - min(ends) <= 0.2 * steady[0][2] + 1.0, steady  # + 1 s: the ETA is shown in seconds
    # log lines from every process above the line, each a line of its own (nothing glued onto the status)
    lines = every.split("\n")
    for who in ("[producer 0] SIGINT: stopping", "[producer 1] joined the trainer", "[trainer] checkpoint "):
        assert any(LOGLINE.match(ln) and who in ln for ln in lines), (who, every)
    assert all(LOGLINE.match(ln) for ln in lines if LOGLINE.search(ln)), every
    assert "^C" not in every, every
    # the run's end: the line ended (kept once, the last state, without an ETA), then the summary
    final = [ln for ln in lines if STATUS.match(ln)]
    assert len(final) == 1 and "ETA" not in final[0], every
    assert re.search(r"^summary: \d+ steps in .* \(SIGINT\)", every, re.M), every
    assert cursor_shown == "1", "the cursor is shown"
