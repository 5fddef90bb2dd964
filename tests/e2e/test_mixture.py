"""Mixtures in real runs (`lmpipe run --mix`, `lmpipe train` + `lmpipe produce`), read through the doc log:
the tokens trained per source follow the weights to within one row; the trained sequence of documents is the
same with 2 and 4 producers, with a producer killed (kill -9) and another started mid-run, and after a kill
-9 of the trainer and --resume; new weights at resume and a schedule keep every document exactly once, and
a 0.98/0.01/0.01 mixture does not deadlock."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.helpers import doc_log_entries, run_lmpipe, small_run, steps_logged, wait_until
from tests.mixruns import at_most_once, corpus, lengths, mix, sequence, tokens_by_source

T, B = 32, 4
STEPS = 120


def flags(port: int, **more: object) -> list[str]:
    """What producers and the trainer both take."""
    return small_run(port, seq_len=T, batch_size=B, strategy="pack", seed=7, **more)


def trainer(tmp: Path, name: str, **more: object) -> list[str]:
    """The trainer's own: 2 shards per source, its doc log."""
    return small_run(None, shards=2, threads=1, doc_log=tmp / f"{name}.jsonl", metrics_port=None, **more)


def test_shares_follow_the_weights_and_the_sequence_does_not_depend_on_producers(tmp_path, port, procs):
    files = corpus(tmp_path)
    weights = (0.6, 0.3, 0.1)
    base = [*mix(files, weights), "--steps", str(STEPS), "--epochs", "0"]
    summary = tmp_path / "two.json"
    rc, out = run_lmpipe(tmp_path, "two", "run", *base, *flags(port, producers=2), *trainer(tmp_path, "two"),
                         "--summary-json", str(summary))  # fmt: skip
    assert rc == 0, out[-3000:]
    two = sequence(doc_log_entries(tmp_path / "two.jsonl"))
    rc, out = run_lmpipe(
        tmp_path, "four", "run", *base, *flags(port, producers=4), *trainer(tmp_path, "four")
    )
    assert rc == 0, out[-3000:]
    assert sequence(doc_log_entries(tmp_path / "four.jsonl")) == two
    got = tokens_by_source(two)
    total = sum(got.values())
    assert total == STEPS * B * T  # packed rows: every row full
    for name, w in zip(files, weights):
        assert abs(got[name] - w * total) <= T, (name, got, total)
    mixture = json.loads(summary.read_text())["mixture"]
    assert {n: m["tokens"] for n, m in mixture.items()} == got
    assert [round(mixture[n]["target"], 3) for n in files] == list(weights)

    # a producer killed mid-run and a new one started: the same sequence
    base, steps = [*mix(files, weights), "--epochs", "0", *flags(port, producers=2)], ["--steps", str(STEPS)]
    train = procs.start("train", *base, *steps, *trainer(tmp_path, "killed"), name="trainer")
    p0 = procs.start("produce", *base, name="p0")
    procs.start("produce", *base, name="p1")
    wait_until(lambda: steps_logged(tmp_path / "killed.jsonl") >= 8, 90, "step 8")
    os.kill(p0.pid, signal.SIGKILL)
    p0.wait()
    procs.start("produce", *base, name="p2")
    assert procs.wait(train, 120) == 0, procs.log(train)[-3000:]
    assert "left (connection closed)" in procs.log(train)
    assert sequence(doc_log_entries(tmp_path / "killed.jsonl")) == two


def test_kill_9_and_resume_trains_the_identical_sequence(tmp_path, port, procs, tok):
    files = corpus(tmp_path)
    base = [*mix(files, (0.5, 0.35, 0.15)), "--epochs", "1", "--steps", "0"]
    rc, out = run_lmpipe(
        tmp_path, "whole", "run", *base, *flags(port, producers=2), *trainer(tmp_path, "whole")
    )
    assert rc == 0, out[-3000:]
    assert "source code has no more data" in out  # 800 documents at 0.35 before 400 at 0.15
    whole = sequence(doc_log_entries(tmp_path / "whole.jsonl"))
    at_most_once(whole, lengths(tok, files), whole={"code"})

    ck = tmp_path / "ck"
    args = ["run", *base, *flags(port, producers=2), *trainer(tmp_path, "killed"), "--checkpoint-dir", str(ck),
            "--checkpoint-every", "4", "--resume", "auto"]  # fmt: skip
    first = procs.start(*args, name="first")
    wait_until(lambda: steps_logged(tmp_path / "killed.jsonl") >= 11, 90, "step 11")
    os.killpg(first.pid, signal.SIGKILL)  # the trainer and its producers
    first.wait()
    entries = doc_log_entries(tmp_path / "killed.jsonl")
    session = entries[0]["batches"][0]["session"]
    rc, out = run_lmpipe(tmp_path, "resumed", *args)
    assert rc == 0, out[-3000:]
    at = int(out.split("resumed from ")[1].split(": step ")[1].split(",")[0])
    assert at >= 4
    assert sequence(doc_log_entries(tmp_path / "killed.jsonl"), session, at) == whole


def test_new_weights_at_resume_and_a_schedule_keep_every_document_once(tmp_path, port, tok):
    files = corpus(tmp_path)
    toml = tmp_path / "mix.toml"
    sources = "".join(f'[sources.{n}]\ndata = ["{p}"]\nweight = 1\nepochs = 1\n' for n, p in files.items())
    toml.write_text(
        sources + "[[schedule]]\nstep = 0\nweights = { web = 0.2, code = 0.7, math = 0.1 }\n"
        "[[schedule]]\nstep = 6\nweights = { web = 0.6, code = 0.2, math = 0.2 }\n"
    )
    ck = tmp_path / "ck"
    common = [
        *flags(port, producers=2),
        *trainer(tmp_path, "docs"),
        "--checkpoint-dir",
        str(ck),
        "--resume",
        "auto",
    ]
    rc, out = run_lmpipe(tmp_path, "scheduled", "run", "--mix-file", str(toml), "--steps", "10", *common)
    assert rc == 0, out[-3000:]
    # the same sources, new weights: a lopsided mixture from step 10 on, until math runs out
    toml.write_text(
        "".join(f'[sources.{n}]\ndata = ["{p}"]\nweight = {w}\nepochs = 1\n'
                for (n, p), w in zip(files.items(), (0.01, 0.01, 0.98)))
    )  # fmt: skip
    rc, out = run_lmpipe(tmp_path, "lopsided", "run", "--mix-file", str(toml), "--steps", "0", *common)
    assert rc == 0, out[-3000:]
    assert "mixture weights at step 10: web 0.6 -> 0.01, code 0.2 -> 0.01, math 0.2 -> 0.98" in out
    entries = doc_log_entries(tmp_path / "docs.jsonl")
    assert len({e["batches"][0]["session"] for e in entries}) == 2
    at_most_once(sequence(entries), lengths(tok, files), whole={"math"})
