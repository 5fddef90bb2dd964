"""The console script itself: a usage mistake is one line on stderr and exit status 2 from `python -m lmpipe`,
as tests/unit/test_cli_errors.py checks for every mistake through `lmpipe.cli.main` in-process; and a mistake
only a running producer can see (a corpus file changed under it) stops the run with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, lmpipe_env


def lmpipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmpipe", *args], env={**lmpipe_env(), **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "args, env, line",
    [
        # argparse's own mistake, before any of ours
        (["run", "--sequence-length", "5"], {}, "lmpipe: unrecognized arguments: --sequence-length 5"),
        # a setting's check, the value named as the variable that gave it
        (["train", "--metrics-port", "-1"], {"LMPIPE_ACCUM": "0"}, "lmpipe train: LMPIPE_ACCUM=0"),
        # a check after the settings are built (lmpipe/launch.py), said through the logger
        (["run", "--metrics-port", "-1", "--vocab-size", "10"], {},
         "lmpipe run: --vocab-size 10 is smaller than the tokenizer's"),
    ],
    ids=["argparse", "setting-from-variable", "later-check"],
)  # fmt: skip
def test_the_console_script_says_a_usage_mistake_in_one_line_and_exits_2(port, args, env, line):
    out = lmpipe(*args, "--port", str(port), env=env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
    assert line in out.stderr, out.stderr


@pytest.mark.slow
def test_a_corpus_file_changed_during_the_run_stops_it_in_one_line(procs, tmp_path, port):
    """A corpus file emptied under --epochs 0 (train until stopped): the producer took the empty pass for the
    end of its data, and the run ended with exit 0 as if complete. The producer now stops at the pass that
    finds the file changed, with one line naming it and what changed; the run fails (not retried)."""
    from lmpipe.producer import builtin_corpus

    data = tmp_path / "c.txt"
    data.write_text("\n\n".join(builtin_corpus.document(3, i) for i in range(40)) + "\n")
    size = data.stat().st_size
    p = procs.start(
        "run", "--data", str(data), "--epochs", "0", "--steps", "0", "--consume-only", "--producers", "1",
        "--port", str(port), "--metrics-port", "-1", "--log-every", "5", name="run",
    )  # fmt: skip
    procs.wait_for(p, "step 10")  # the producer started: the file it found is the run's
    data.write_bytes(b"")
    assert procs.wait(p, timeout=60) == 1, procs.log(p)
    text = procs.log(p)
    said = [line for line in text.splitlines() if "changed during the run" in line]
    assert len(said) == 1, text
    assert said[0].endswith(
        f"[producer 0] corpus file {data} changed during the run ({size:,} -> 0 bytes); the run cannot go on "
        "reading it as it was: restore it or start a new run"
    ), said[0]
    assert "producer 0 exited with code 2" in text and "Traceback" not in text
