"""`lmpipe train --consume-only`: the pipeline without a model (real processes, CPU; one test on CUDA).

The trainer receives, validates and copies every batch to the device and builds no model. What must still
hold: every document once per epoch in --doc-log, checkpoints of the producers' cursors that a kill -9 and
--resume pick up without losing or repeating a document, and a summary that says where the time went.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    doc_pieces,
    rank_logs,
    run_lmpipe,
    steps_logged,
    trained_pieces,
    wait_until,
)

pytestmark = pytest.mark.slow

DOCS = 400
COMMON = ["--builtin-docs", str(DOCS), "--seq-len", "64", "--batch-size", "4", "--epochs", "1",
          "--producers", "2", "--metrics-port", "-1"]  # fmt: skip
STAGES = re.compile(
    r"consume only \(no model\): ([\d,]+) batches; per batch: receive \+ decode \+ validate ([\d.]+) ms "
    r"\(receive thread busy \d+% of a core\), copy to the device ([\d.]+) ms, data wait ([\d.]+) ms"
)


def test_kill_9_mid_epoch_and_resume_trains_every_document_once(procs, tmp_path, port, tok):
    common = [*COMMON, "--port", str(port)]
    log, ck = tmp_path / "docs.jsonl", tmp_path / "ck"
    train = ["train", *common, "--consume-only", "--steps", "0", "--checkpoint-dir", str(ck),
             "--checkpoint-every", "4", "--doc-log", str(log), "--resume", "auto"]  # fmt: skip
    t1 = procs.start(*train, name="trainer1")
    procs.start("produce", *common, "--worker", "0", name="producer0")
    # producer 1 is not started yet: the epoch cannot end, so the kill lands mid-epoch on any machine
    wait_until(lambda: steps_logged(log) >= 9, 90, "step 9")
    assert "no model (--consume-only)" in procs.log(t1)
    os.kill(t1.pid, signal.SIGKILL)
    t1.wait()
    first_session = doc_log_entries(log)[0]["batches"][0]["session"]

    t2 = procs.start(*train, name="trainer2")
    procs.start("produce", *common, "--worker", "1", name="producer1")
    assert t2.wait(timeout=120) == 0, procs.log(t2)
    out = procs.log(t2)
    resumed = int(re.search(r"resumed from \S+: step (\d+)", out).group(1))
    assert resumed >= 8 and resumed % 4 == 0
    assert_exactly_once(
        trained_pieces(doc_log_entries(log), first_session, resumed), builtin_lengths(tok, DOCS)
    )
    stages = STAGES.search(out)
    assert stages, out[-2000:]
    batches = int(stages.group(1).replace(",", ""))
    assert batches == steps_logged(log) - resumed - sum(  # every batch trainer2 consumed, one per step
        1
        for e in doc_log_entries(log)
        if e["batches"][0]["session"] == first_session and e["step"] >= resumed
    )
    assert float(stages.group(2)) > 0 and float(stages.group(3)) > 0


def test_a_model_run_refuses_a_consume_only_checkpoint(procs, tmp_path, port):
    ck = tmp_path / "ck"
    common = [*COMMON, "--port", str(port), "--checkpoint-dir", str(ck)]
    first = procs.start("run", *common, "--consume-only", "--steps", "6", name="consume")
    assert first.wait(timeout=120) == 0, procs.log(first)
    assert (ck / "latest").is_file()
    model = procs.start("run", *common, "--steps", "12", "--resume", "auto", name="model")
    assert model.wait(timeout=120) == 2, procs.log(model)
    err = procs.log(model)
    assert "model: checkpoint has 'none (--consume-only)'" in err and "Traceback" not in err
    # nor is it exported: it wrote a safetensors file of no tensors and said "wrote"
    out = tmp_path / "model.safetensors"
    export = procs.start("export", str(ck), "--out", str(out), name="export")
    assert export.wait(timeout=60) == 2, procs.log(export)
    said = procs.log(export).strip()
    assert len(said.splitlines()) == 1 and "a --consume-only checkpoint: no model to export" in said, said
    assert not out.exists()


@pytest.mark.cuda
def test_consume_only_copies_to_the_gpu_on_the_copy_stream(procs, tmp_path, port, tok):
    log = tmp_path / "docs.jsonl"
    p = procs.start("run", *COMMON, "--port", str(port), "--consume-only", "--device", "cuda",
                    "--steps", "0", "--doc-log", str(log), name="run")  # fmt: skip
    assert p.wait(timeout=120) == 0, procs.log(p)
    out = procs.log(p)
    assert "on cuda" in out and STAGES.search(out), out[-2000:]
    assert_exactly_once(trained_pieces(doc_log_entries(log), "", 0), builtin_lengths(tok, DOCS))


def test_two_ranks_consume_every_document_once_and_the_summary_counts_the_job(tmp_path, port, tok):
    """Under torchrun the summary's tokens are the job's; its batch count was rank 0's alone."""
    rc, out = run_lmpipe(tmp_path, "ddp", "run", *COMMON, "--consume-only", "--steps", "0", "--port", str(port),
                     "--doc-log", str(tmp_path / "docs.jsonl"), nproc=2)  # fmt: skip
    assert rc == 0, out[-3000:]
    entries = [e for p in rank_logs(tmp_path, "docs") for e in doc_log_entries(p)]
    assert_exactly_once(doc_pieces(entries), builtin_lengths(tok, DOCS))
    stages = re.search(r"consume only \(no model\): ([\d,]+) batches; per batch \(rank 0 of 2\): ", out)
    assert stages, out[-2000:]
    assert int(stages.group(1).replace(",", "")) == sum(len(e["batches"]) for e in entries)
