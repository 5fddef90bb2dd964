"""The corpus a trainer trains on is the one it was told (real processes and sockets, CPU).

`lmpipe train --data X` trains on X: a producer serving another corpus is refused, and a missing X is one
line before anything starts. A checkpoint remembers its corpus's contents (header "data_content"), so that
a file of the same name and size but other content does not resume. A checkpoint that finished --epochs is
not resumed into a run that trains nothing.
"""

from __future__ import annotations

import json

import pytest

from lmpipe.consumer.checkpoint import CheckpointManager
from lmpipe.producer import builtin_corpus
from tests.helpers import doc_log_entries, doc_pieces, small_run

pytestmark = pytest.mark.slow

SMALL = small_run(None, seq_len=64, batch_size=4, producers=1)
T = ["--threads", "1"]  # the trainer's


def corpus(path, seed: int, n: int = 120):
    path.write_text("\n".join(builtin_corpus.document(seed, i).replace("\n", " ") for i in range(n)) + "\n")
    return path


def same_size_other_content(path) -> None:
    text = path.read_text()
    swapped = text.translate(str.maketrans("ae", "ea"))
    assert swapped != text and len(swapped.encode()) == len(text.encode())
    path.write_text(swapped)


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.strip().splitlines() if ln.strip()]


def test_train_data_refuses_a_producer_of_another_corpus(procs, tmp_path, port):
    """It trained on what the first producer served: --data was ignored."""
    a, b = corpus(tmp_path / "a.txt", 1), corpus(tmp_path / "b.txt", 2)
    common = ["--port", str(port), "--doc-split", "line", *SMALL]
    train = procs.start("train", *common, *T, "--data", str(a), "--steps", "3", name="trainer")
    wrong = procs.start("produce", *common, "--data", str(b), name="wrong")
    assert procs.wait(wrong, timeout=90) == 2, procs.log(wrong)
    refused = "trainer refused this producer: config mismatch: data: producer has 'line|b.txt:"
    assert refused in procs.log(wrong)
    assert train.poll() is None, "a refused producer does not take the trainer down"
    right = procs.start("produce", *common, "--data", str(a), name="right")
    assert procs.wait(train, timeout=120) == 0, procs.log(train)
    assert "step 3/3" in procs.log(train)
    assert procs.wait(right, timeout=30) == 0, procs.log(right)


def test_train_data_that_is_missing_is_one_line(procs, tmp_path, port):
    p = procs.start(
        "train", "--port", str(port), *SMALL, *T, "--data", str(tmp_path / "nonexist.txt"), name="t"
    )
    assert procs.wait(p, timeout=60) == 2, procs.log(p)
    lines = error_lines(procs.log(p))
    assert len(lines) == 1 and "--data" in lines[0] and "nonexist.txt" in lines[0], lines
    assert "leave --data off the trainer" in lines[0]  # multi-host: the corpus may live with the producers


def test_resume_refuses_files_whose_contents_changed(procs, tmp_path, port):
    """The checkpoint held names and sizes only: an edited file of the same size resumed, and its document
    boundaries (record ids, cursors) were no longer the checkpoint's."""
    a, ck = corpus(tmp_path / "a.txt", 1), tmp_path / "ck"
    base = ["--port", str(port), "--doc-split", "line", *SMALL, "--checkpoint-dir", str(ck)]
    r = procs.start("run", *base, *T, "--data", str(a), "--steps", "3", name="make")
    assert procs.wait(r, timeout=120) == 0, procs.log(r)
    header = json.loads((CheckpointManager(ck).latest() / "header.json").read_text())
    assert header["data"].startswith("line|a.txt:") and len(header["data_content"]) >= 8
    original = a.read_text()
    same_size_other_content(a)
    for cmd in ("run", "train"):  # `train --data` checks it as `run` does
        p = procs.start(
            cmd, *base, *T, "--data", str(a), "--steps", "6", "--resume", "auto", name=f"changed-{cmd}"
        )
        assert procs.wait(p, timeout=60) == 2, procs.log(p)
        lines = error_lines(procs.log(p))
        assert len(lines) == 1 and "contents changed since it was written" in lines[0], lines
        assert str(CheckpointManager(ck).latest()) in lines[0]
    # `train` without --data: the receiver refuses a producer of the changed files, as the checkpoint's
    train = procs.start("train", *base, *T, "--steps", "6", "--resume", "auto", name="trainer")
    wrong = procs.start("produce", "--port", str(port), "--doc-split", "line", *SMALL, "--data", str(a),
                        name="wrong")  # fmt: skip
    assert procs.wait(wrong, timeout=120) == 2, procs.log(wrong)
    assert "config mismatch: data_content: the producer's corpus files have the same names and sizes but other " \
        "content" in procs.log(wrong)  # fmt: skip
    assert train.poll() is None
    train.kill()
    a.write_text(original)
    same = procs.start("run", *base, *T, "--data", str(a), "--steps", "6", "--resume", "auto", name="same")
    assert procs.wait(same, timeout=120) == 0, procs.log(same)
    assert "resumed from" in procs.log(same)


def test_an_old_checkpoint_without_data_content_still_resumes(procs, tmp_path, port):
    a, ck = corpus(tmp_path / "a.txt", 1), tmp_path / "ck"
    base = ["--port", str(port), "--doc-split", "line", *SMALL, "--checkpoint-dir", str(ck), "--data", str(a)]
    r = procs.start("run", *base, *T, "--steps", "3", name="make")
    assert procs.wait(r, timeout=120) == 0, procs.log(r)
    f = CheckpointManager(ck).latest() / "header.json"
    header = json.loads(f.read_text())
    del header["data_content"]
    f.write_text(json.dumps(header))
    same_size_other_content(a)  # not known to the checkpoint: not checked
    p = procs.start("run", *base, *T, "--steps", "6", "--resume", "auto", name="old")
    assert procs.wait(p, timeout=120) == 0, procs.log(p)
    assert "resumed from" in procs.log(p)


def test_train_resume_with_another_data_is_refused(procs, tmp_path, port):
    a, b, ck = corpus(tmp_path / "a.txt", 1), corpus(tmp_path / "b.txt", 2, 130), tmp_path / "ck"
    base = ["--port", str(port), "--doc-split", "line", *SMALL, "--checkpoint-dir", str(ck)]
    r = procs.start("run", *base, *T, "--data", str(a), "--steps", "3", name="make")
    assert procs.wait(r, timeout=120) == 0, procs.log(r)
    p = procs.start("train", *base, *T, "--data", str(b), "--steps", "6", "--resume", "auto", name="other")
    assert procs.wait(p, timeout=60) == 2, procs.log(p)
    lines = error_lines(procs.log(p))
    assert len(lines) == 1 and "resume with the same --data" in lines[0], lines


def test_a_checkpoint_that_finished_its_epochs_is_not_resumed_into_nothing(procs, tmp_path, port):
    """It started producers, printed `64 steps in 0.0 s (end of data) | loss nan -> nan` and exited 0. More
    epochs go on from it: every document once more, in the next epoch's order; fewer are refused."""
    a, ck, log = corpus(tmp_path / "a.txt", 1, 60), tmp_path / "ck", tmp_path / "docs.jsonl"
    base = ["--port", str(port), "--doc-split", "line", *SMALL, "--checkpoint-dir", str(ck), "--data", str(a),
            "--steps", "0", "--doc-log", str(log)]  # fmt: skip
    r = procs.start("run", *base, *T, "--epochs", "2", name="make")
    assert procs.wait(r, timeout=180) == 0, procs.log(r)
    assert "end of data" in procs.log(r)
    first = doc_log_entries(log)
    again = procs.start("run", *base, *T, "--epochs", "2", "--resume", "auto", name="again")
    assert procs.wait(again, timeout=60) == 2, procs.log(again)
    text = procs.log(again)
    assert "finished --epochs 2" in text and "start a new run" in text, text
    assert "steps in" not in text and "loss nan" not in text
    fewer = procs.start("run", *base, *T, "--epochs", "1", "--resume", "auto", name="fewer")
    assert procs.wait(fewer, timeout=60) == 2, procs.log(fewer)
    assert "stream.epochs: checkpoint has 2, this run has 1: resume with --epochs 2 or more (0: until " \
        "stopped); to train fewer, start a new run" in procs.log(fewer)  # fmt: skip
    more = procs.start("run", *base, *T, "--epochs", "3", "--resume", "auto", name="more")
    assert procs.wait(more, timeout=180) == 0, procs.log(more)
    assert "shards go on into epoch 3" in procs.log(more) and "end of data" in procs.log(more)
    entries = doc_log_entries(log)
    assert entries[: len(first)] == first and len(entries) > len(first)
    by_run = [doc_pieces(first), doc_pieces(entries[len(first) :])]
    assert sorted(by_run[1]) == sorted(by_run[0])  # the third epoch: every document of the first two
    for did, parts in by_run[0].items():
        assert sum(n for _, n in by_run[1][did]) * 2 == sum(n for _, n in parts), did  # once, not twice
