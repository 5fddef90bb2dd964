"""Issue 43: asynchronous checkpoints (--checkpoint-mode async, forced here on CPU) keep exactly-once.

A trainer killed (kill -9) while a background write is in flight leaves the checkpoint before it as the
latest and complete one, and the resumed run trains every document exactly once (doc-log accounting, as in
test_resume.py); a write that fails stops the run in one line; SIGTERM waits for the write in flight. The write is made slow on purpose by the
test hook LMPIPE_TEST_CHECKPOINT_WRITE_DELAY (consumer/checkpoint.py): seconds slept after the checkpoint's
files are written in their temporary folder, before the rename.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lmpipe.consumer.checkpoint import TEST_WRITE_DELAY, CheckpointManager
from tests.helpers import (
    REPO,
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    lmpipe_env,
    small_run,
    trained_pieces,
    wait_until,
)

SMALL = small_run(None, builtin_docs=80, seq_len=64, batch_size=4, bucket_window=32)


def test_a_kill_during_a_background_write_resumes_from_the_checkpoint_before_exactly_once(
    procs, tmp_path, port, tok
):
    common = ["--port", str(port), "--epochs", "1", "--producers", "2", *SMALL]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train_args = ["train", *common, "--steps", "0", "--checkpoint-dir", str(ck), "--checkpoint-mode", "async",
                  "--doc-log", str(log), "--resume", "auto", "--log-every", "5"]  # fmt: skip
    # every write sleeps 4 s before its rename: step 4's checkpoint is due while step 2's is being written
    t1 = procs.start(*train_args, "--checkpoint-every", "2", name="trainer1",
                     env={**lmpipe_env(), TEST_WRITE_DELAY: "4"})  # fmt: skip
    for w in range(2):
        procs.start("produce", *common, "--worker", str(w), name=f"producer{w}")

    def step4_in_flight() -> bool:  # its files are written and fsynced; the hook holds its rename back
        return any((d / "header.json").is_file() for d in ck.glob(".step-00000004.tmp-*"))

    wait_until(step4_in_flight, 120, "the background write of step 4")
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    said = procs.log(t1)
    assert "checkpoint step 4 is due while the write of step 2 is still running" in said, said[-3000:]
    assert "step-00000004 written" not in said
    assert (ck / "latest").read_text().strip() == "step-00000002", "the checkpoint before stays the latest"
    first = doc_log_entries(log)
    first_session = first[0]["batches"][0]["session"]

    # no delay: resumes, trains to the end of the data; its last checkpoint is written in the background
    t2 = procs.start(*train_args, "--checkpoint-every", "50", name="trainer2")
    assert t2.wait(timeout=180) == 0, procs.log(t2)
    text = procs.log(t2)
    assert "resumed from " in text and "step-00000002: step 2," in text, text[-3000:]
    assert_exactly_once(trained_pieces(doc_log_entries(log), first_session, 2), builtin_lengths(tok, 80))
    assert not list(ck.glob(".step-*.tmp-*")), "the killed write's temporary folder is cleaned up"


def test_a_failing_background_write_stops_the_run_in_one_line(tmp_path, port):
    ck = tmp_path / "ck"
    ck.mkdir()
    cmd = [sys.executable, "-m", "lmpipe", "run", "--steps", "8", "--builtin-docs", "200", "--seq-len", "64",
           "--batch-size", "4", "--port", str(port), "--metrics-port", "-1", "--producers", "1",
           "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--checkpoint-mode", "async"]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=REPO, env=lmpipe_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)  # fmt: skip
    try:
        # the write of step 2 cannot make its temporary folder: a file has its name (the trainer is this pid)
        (ck / f".step-00000002.tmp-{p.pid}").write_text("in the way")
        out, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode not in (0, None), out
    assert "Traceback" not in out, out
    said = [line for line in out.splitlines() if "could not write checkpoint step 2" in line]
    assert len(said) == 1 and "[trainer]" in said[0], out
    assert not list(ck.glob("step-*")), "nothing half-written took a checkpoint's name"
    assert "summary:" not in out, "the run stopped at the failure, it did not go on to its end"


def test_sigterm_during_a_background_write_waits_for_it_and_says_so(procs, tmp_path, port):
    ck = tmp_path / "ck"
    p = procs.start("run", *small_run(port, steps=0, builtin_docs=400, seq_len=64, batch_size=4, producers=1),
                    "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--checkpoint-mode", "async",
                    name="trainer", env={**lmpipe_env(), TEST_WRITE_DELAY: "3"})  # fmt: skip
    wait_until(lambda: any((d / "header.json").is_file() for d in ck.glob(".step-00000002.tmp-*")), 120,
               "the background write of step 2")  # fmt: skip
    os.kill(p.pid, signal.SIGTERM)
    assert procs.wait(p, timeout=120) == 0, procs.log(p)[-3000:]
    text = procs.log(p)
    last = CheckpointManager(ck).latest()
    assert last is not None  # the step it stopped at: 2, or a later one it was training when the signal came
    assert f"SIGTERM: waiting for the checkpoint write of step {int(last.name[5:])} in flight" in text, text[
        -3000:
    ]
    assert "step-00000002 written" in text, "the write in flight when the signal came landed"
    assert not list(ck.glob(".step-*.tmp-*"))
