"""Every usage mistake is one line on stderr naming the flag or variable, exit status 2, no traceback.

Each case runs the real command line in this process: `lmpipe.cli.main(argv)`, the console script's own
entry (its parser, its checks, its messages), with the environment a fresh process would see. The checks
run before a model is built or a process started. tests/e2e/test_cli_errors.py proves that the console
script itself prints the same one line and exits 2, and that a mistake only a running producer can see (a
corpus file changed under it) stops the run with one line too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lmpipe import cli
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import endpoints
from tests.helpers import REPO, process_state


@pytest.fixture
def lmpipe(lmpipe_cli):
    """`lmpipe ARGS` as the console script runs it, in this process (tests/conftest.py's lmpipe_cli)."""
    return lmpipe_cli


@dataclass
class Ctx:
    tmp: Path
    port: int
    checkpoint: Path
    shards: Path  # a good prepared shard set (lmpipe prepare), to copy and damage
    env: dict[str, str] = field(default_factory=dict)
    hold: list[Any] = field(default_factory=list)

    def listen(self, port: int) -> None:
        """Take `port` the way another server would."""
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        self.hold.append(s)

    def claim(self, port: int) -> None:
        """Take `port` the way another trainer on the default transport (Unix sockets) would."""
        ep = endpoints(PipelineConfig(port=port, runtime_dir=str(self.tmp / "run")))
        ep.claim(port)
        self.hold.append(ep)


def _state_sha(path: Path) -> None:
    header = json.loads((path / "header.json").read_text())
    header["state_sha256"] = hashlib.sha256((path / "state.pt").read_bytes()).hexdigest()
    (path / "header.json").write_text(json.dumps(header))


def empty_corpus(c: Ctx) -> list[str]:
    (c.tmp / "empty.txt").write_text("\n\n   \n")
    (c.tmp / "blank.jsonl").write_text('{"text": " "}\n\n')
    return ["--data", str(c.tmp / "empty.txt"), str(c.tmp / "blank.jsonl")]


def tar_gz_corpus(c: Ctx) -> list[str]:
    """A .tar.gz was trained as text: its tar header and NUL padding too (the NUL check skipped gzip)."""
    import tarfile

    (c.tmp / "train.txt").write_text("A first document.\n\nA second one.\n")
    with tarfile.open(c.tmp / "corpus.tar.gz", "w:gz") as tar:
        tar.add(c.tmp / "train.txt", arcname="train.txt")
    return ["run", "--data", str(c.tmp / "corpus.tar.gz")]


def utf16_corpus(bom: bool) -> Callable[[Ctx], list[str]]:
    """Text as Windows Notepad's "Unicode" saves it: with a byte-order mark, or without one."""

    def make(c: Ctx) -> list[str]:
        text = "A first document.\n\nA second one, with more words in it.\n"
        (c.tmp / "notes.txt").write_bytes(text.encode("utf-16" if bom else "utf-16-le"))
        return ["run", "--data", str(c.tmp / "notes.txt")]

    return make


def json_array(c: Ctx) -> list[str]:
    """What json.dump(records, f, indent=2) writes, named .json: each line of it is junk as JSON Lines."""
    records = [{"prompt": f"Q{i}?", "completion": f" A{i}"} for i in range(3)]
    (c.tmp / "sft.json").write_text(json.dumps(records, indent=2))
    return ["--data", str(c.tmp / "sft.json")]


def hf_labels(c: Ctx) -> list[str]:
    """Records tokenized the Hugging Face way: `labels` (-100 where untrained) beside the ids."""
    records = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"ids": [8, 9], "labels": [-100, 9]}]
    (c.tmp / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return ["--data", str(c.tmp / "hf.jsonl")]


def shards_with_meta(change: Callable[[dict], Any] | bytes) -> Callable[[Ctx], list[str]]:
    """The prepared shards, their meta.json hand-edited: `change` returns the new JSON value (or edits the
    map in place and returns None), or is the file's new bytes."""

    def make(c: Ctx) -> list[str]:
        d = c.tmp / "shards"
        shutil.copytree(c.shards, d)
        if isinstance(change, bytes):
            (d / "meta.json").write_bytes(change)
        else:
            meta = json.loads((d / "meta.json").read_text())
            new = change(meta)
            (d / "meta.json").write_text(json.dumps(meta if new is None else new))
        return ["run", "--data", str(d)]

    return make


def resume_state_without(key: str) -> Callable[[Ctx], list[str]]:
    def make(c: Ctx) -> list[str]:
        ck = c.tmp / "ck"
        shutil.copytree(c.checkpoint.parent, ck)
        step = ck / c.checkpoint.name
        state = torch.load(step / "state.pt", weights_only=True)
        del state[key]
        torch.save(state, step / "state.pt")
        _state_sha(step)
        return ["train", "--port", str(c.port), "--checkpoint-dir", str(ck), "--resume", "auto"]

    return make


def export_garbage(matching_checksum: bool) -> Callable[[Ctx], list[str]]:
    def make(c: Ctx) -> list[str]:
        step = c.tmp / "step"
        shutil.copytree(c.checkpoint, step)
        (step / "state.pt").write_bytes(os.urandom(4096))
        if matching_checksum:
            _state_sha(step)
        return ["export", str(step), "--out", str(c.tmp / "m.safetensors")]

    return make


def port_taken(offset: int, cmd: str) -> Callable[[Ctx], list[str]]:
    """A TCP port in use (the transport of --trusted-network and --curve-dir)."""

    def make(c: Ctx) -> list[str]:
        c.listen(c.port + offset)
        return [cmd, "--port", str(c.port), "--trusted-network"]

    return make


def trainer_on_port(cmd: str) -> Callable[[Ctx], list[str]]:
    """Another trainer on the same port in the same runtime directory (the default transport)."""

    def make(c: Ctx) -> list[str]:
        c.claim(c.port)
        return [cmd, "--port", str(c.port), "--runtime-dir", str(c.tmp / "run")]

    return make


def open_runtime_dir(c: Ctx) -> list[str]:
    d = c.tmp / "shared"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    return ["train", "--runtime-dir", str(d)]


def env(var: str, value: str, *argv: str) -> Callable[[Ctx], list[str]]:
    def make(c: Ctx) -> list[str]:
        c.env[var] = value
        return list(argv)

    return make


def _over_the_corpus(c: Ctx, flag: str) -> list[str]:
    (c.tmp / "a.txt").write_text("a document\n")
    return ["run", "--data", str(c.tmp / "a.txt"), flag, str(c.tmp / "a.txt")]


def _over_the_tokenizer(c: Ctx) -> list[str]:
    tok = c.tmp / "tok.json"
    shutil.copy(REPO / "shared" / "assets" / "builtin-tokenizer.json", tok)
    return ["run", "--tokenizer", str(tok), "--summary-json", str(tok)]


def _a_client_key(c: Ctx) -> list[str]:
    (c.tmp / "client.key").write_text("a producer's public key, copied here\n")
    return []


def touch(c: Ctx, name: str) -> list[str]:
    (c.tmp / name).write_text("not a directory")
    return []


# single-value flags an unset $VAR emptied (`--checkpoint-dir "$CK"`)
EMPTIED = ("checkpoint-dir", "resume", "tokenizer", "summary-json", "doc-log", "runtime-dir", "curve-dir")

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

# (id, argv or a function of the context giving it, text the one line must contain)
CASES = [
    # issue 8, item 5: tracebacks before
    ("data-port-in-use", port_taken(0, "run"), "--port"),
    ("control-port-in-use", port_taken(1, "train"), "--port"),
    ("trainer-on-the-port", trainer_on_port("run"), "--port"),
    ("runtime-dir-open-to-others", open_runtime_dir, "--runtime-dir"),
    ("curve-dir-missing", ["train", "--curve-dir", "/nonexistent/keys"], "--curve-dir /nonexistent/keys"),
    ("curve-dir-without-keys", lambda c: ["train", "--curve-dir", str(c.tmp)], "--curve-dir"),
    ("host-invalid", ["train", "--host", "999.1.1.1", "--trusted-network"], "--host 999.1.1.1"),
    pytest.param("device-cuda-no-gpu", ["run", "--device", "cuda"], "--device cuda", marks=no_gpu),
    ("device-nonsense", ["run", "--device", "nonsense"], "--device nonsense"),
    ("log-every-0", ["run", "--log-every", "0"], "--log-every 0"),
    # killed for want of memory minutes later, before
    (
        "batch-beyond-memory",
        ["train", "--batch-size", "100000", "--vocab-size", "1000000"],
        "logits alone take 47,683.7 GiB",
    ),
    ("export-garbage-state", export_garbage(False), "state.pt"),
    # tracebacks, or (inside the checkpoint) an overwritten state.pt, before
    ("export-out-a-folder", lambda c: ["export", str(c.checkpoint), "--out", str(c.tmp)], "not a directory"),
    (
        "export-out-in-missing-folder",
        lambda c: ["export", str(c.checkpoint), "--out", str(c.tmp / "no" / "m.safetensors")],
        "no folder",
    ),
    (
        "export-over-the-checkpoint",
        lambda c: ["export", str(c.checkpoint), "--out", str(c.checkpoint / "state.pt")],
        "is inside the checkpoint",
    ),
    (
        "export-no-checkpoint",
        lambda c: ["export", "/nonexistent", "--out", str(c.tmp / "m.safetensors")],
        "/nonexistent: no checkpoint",
    ),
    ("export-garbage-state-matching-checksum", export_garbage(True), "state.pt: cannot be loaded"),
    (
        "resume-state-lacks-keys",
        resume_state_without("optimizer"),
        "state.pt: not an lmpipe trainer state (no optimizer)",
    ),
    ("env-seq-len-not-int", env("LMPIPE_SEQ_LEN", "abc", "run"), "LMPIPE_SEQ_LEN"),
    # issue 8, item 6: silently accepted before
    ("accum-0", ["run", "--accum", "0"], "--accum 0"),
    ("steps-negative", ["run", "--steps", "-1"], "--steps -1"),
    ("warmup-negative", ["run", "--warmup", "-5"], "--warmup -5"),
    ("max-line-bytes-0", ["run", "--max-line-bytes", "0"], "--max-line-bytes 0"),
    ("shuffle-window-negative", ["run", "--shuffle-window", "-1"], "--shuffle-window -1"),
    ("keep-checkpoints-0", ["run", "--keep-checkpoints", "0"], "--keep-checkpoints 0"),
    ("slots-below-accum", ["run", "--accum", "4", "--slots", "3"], "--slots 3 is fewer than --accum 4"),
    ("empty-corpus-run", lambda c: ["run", *empty_corpus(c)], "no documents in"),
    ("empty-corpus-produce", lambda c: ["produce", *empty_corpus(c)], "no documents in"),
    (
        "json-array-not-lines",
        lambda c: ["run", *json_array(c)],
        "sft.json:1: a JSON array, not JSON Lines: write one object per line",
    ),
    (
        "jsonl-hf-labels",
        lambda c: ["run", *hf_labels(c)],
        'hf.jsonl:1: "labels" is not read: write {"ids": [...], "loss_mask": [...]}',
    ),
    # a hand-edited or damaged shard meta.json: tracebacks before (AttributeError, KeyError, TypeError)
    ("meta-array", shards_with_meta(lambda m: [m]), "shards/meta.json: an array, not a JSON object; restore"),
    ("meta-number", shards_with_meta(lambda m: 5), "shards/meta.json: a number, not a JSON object"),
    ("meta-truncated", shards_with_meta(b'{"format_version": 1, "dty'), "shards/meta.json: unreadable ("),
    ("meta-not-utf8", shards_with_meta(b'{"dtype": "\xff"}'), "shards/meta.json: unreadable ("),
    ("meta-no-shards", shards_with_meta(lambda m: m.pop("shards") and None), "shards is missing, not a list"),
    ("meta-shard-not-object", shards_with_meta(lambda m: m.update(shards=[3])), "shards[0] is a number"),
    (
        "meta-shard-count-string",
        shards_with_meta(lambda m: m["shards"][0].update(tokens="many")),
        "shards[0].tokens is 'many', not a count",
    ),
    (
        "meta-file-outside-the-directory",
        shards_with_meta(lambda m: m["shards"][0]["files"]["tokens"].update(name="../../etc/passwd")),
        "shards[0].files.tokens.name is '../../etc/passwd', not a file name in this directory",
    ),
    (
        "meta-counts-disagree",
        shards_with_meta(lambda m: m.update(tokens=m["tokens"] + 1)),
        "but its shards hold",
    ),
    (
        "meta-vocab-bool",
        shards_with_meta(lambda m: m.update(vocab_size=True)),
        "vocab_size is True, not a count",
    ),
    (
        "meta-tokenizer-facts-bad",
        shards_with_meta(lambda m: m["tokenizer"].update(eos_id="0")),
        "shards/meta.json: tokenizer is a",
    ),
    (
        "meta-tokenizer-facts-disagree",
        shards_with_meta(lambda m: m["tokenizer"].update(hash="0" * 16)),
        "tokenizer disagrees with tokenizer_hash",
    ),
    (
        "empty-corpus-prepare",
        lambda c: ["prepare", *empty_corpus(c), "--out", str(c.tmp / "s")],
        "no documents in",
    ),
    (
        "tokenizer-train-empty",
        lambda c: ["tokenizer", "train", *empty_corpus(c), "--out", str(c.tmp / "t.json")],
        "no text documents in",
    ),
    # and their relatives
    ("env-bad-choice", env("LMPIPE_STRATEGY", "zip", "produce"), "LMPIPE_STRATEGY=zip: unknown strategy"),
    ("env-bad-bool", env("LMPIPE_COMPILE", "maybe", "train"), "LMPIPE_COMPILE"),
    ("env-check", env("LMPIPE_ACCUM", "0", "train"), "LMPIPE_ACCUM=0"),
    ("bad-choice", ["run", "--strategy", "zip"], "--strategy"),
    ("flag-not-int", ["run", "--seq-len", "abc"], "--seq-len"),
    ("unknown-flag", ["run", "--sequence-length", "5"], "--sequence-length"),
    ("log-level", ["--log-level", "loud", "run"], "--log-level loud"),
    ("rank-outside-world", ["produce", "--rank", "2", "--world-size", "2"], "--rank 2"),
    # three tracebacks before: an int overflow in each producer's socket options, then the trainer's allocation
    (
        "batch-too-large",
        ["run", "--batch-size", "100000000"],
        "--batch-size 100000000 x --seq-len 128 is 12,800,000,000 tokens a batch",
    ),
    ("worker-outside-producers", ["produce", "--worker", "2", "--producers", "2"], "--worker 2"),
    ("resume-auto-without-dir", ["train", "--resume", "auto"], "--resume auto needs --checkpoint-dir"),
    ("missing-corpus-file", ["run", "--data", "/nonexistent.txt"], "--data"),
    # --data with nothing after it (an unset $VAR, a glob that matched nothing) trained the built-in corpus
    ("data-flag-without-a-path", ["run", "--data", "--steps", "5"], "--data: expected at least one argument"),
    ("env-data-unclosed-quote", env("LMPIPE_DATA", "'my corpus.txt", "run"), "LMPIPE_DATA"),
    ("corpus-not-a-file", ["run", "--data", "/dev/null"], "/dev/null is not a regular file"),
    # UTF-16 was called "binary data (a NUL byte at offset 3)"
    ("corpus-utf16", utf16_corpus(bom=True), "notes.txt: UTF-16 text, not UTF-8; convert it (iconv"),
    ("corpus-utf16-no-bom", utf16_corpus(bom=False), "notes.txt: UTF-16 text, not UTF-8"),
    ("corpus-tar-gz", tar_gz_corpus, "once decompressed: an archive?), not a text or JSONL corpus"),
    ("missing-tokenizer", ["produce", "--tokenizer", "/nonexistent.json"], "--tokenizer"),
    (
        "tokenizer-a-folder",
        lambda c: ["run", "--tokenizer", str(c.tmp)],
        "is a directory; name its tokenizer.json",
    ),
    ("loss-scale", ["train", "--loss-scale", "static:0"], "--loss-scale static:0"),
    ("fp8-on-cpu", ["train", "--device", "cpu", "--precision", "fp8"], "--precision fp8 needs a GPU"),
    # these three were said by the trainer after `run` had started its producers
    ("run-fp8-on-cpu", ["run", "--device", "cpu", "--precision", "fp8"], "--device cpu is the CPU"),
    (
        "run-flash-on-cpu",
        ["run", "--device", "cpu", "--attention", "flash"],
        "--attention flash needs a CUDA",
    ),
    ("run-vocab-too-small", ["run", "--vocab-size", "10"], "--vocab-size 10 is smaller than the tokenizer's"),
    ("tokenizer-without-out", ["tokenizer", "train"], "--out"),
    # past int64: msgpack's OverflowError in every producer's hello; past 65535: bind() in every producer
    ("seed-past-int64", ["run", "--seed", str(2**64)], "--seed: '18446744073709551616' is out of range"),
    # numpy's MemoryError (7.28 TiB) in every producer
    (
        "builtin-docs-huge",
        ["run", "--builtin-docs", str(10**12)],
        "--builtin-docs 1000000000000: must be in 1..100000000",
    ),
    # access() lets root write /proc: the run trained every step, then failed at its final checkpoint
    (
        "checkpoint-dir-in-proc",
        ["run", "--checkpoint-dir", "/proc/lmpipe-x"],
        "--checkpoint-dir /proc/lmpipe-x: ",
    ),
    ("summary-json-in-proc", ["run", "--summary-json", "/proc/lmpipe-x"], "--summary-json /proc/lmpipe-x: "),
    # an empty value (an unset $VAR) was read as none: no checkpoints, the built-in tokenizer, no summary;
    # a traceback (AssertionError) where the flag is required
    *[
        (f"{f}-empty", ["run", f"--{f}", "", "--steps", "2"], f"--{f}: an empty value (an unset")
        for f in EMPTIED
    ],
    ("metrics-port-empty", ["train", "--metrics-port", ""], "--metrics-port: an empty value"),
    ("seq-len-empty", ["run", "--seq-len", ""], "--seq-len: an empty value"),
    ("tokenizer-out-empty", ["tokenizer", "train", "--out", ""], "--out: an empty value"),
    ("prepare-out-empty", ["prepare", "--data", "README.md", "--out", ""], "--out: an empty value"),
    # a lone client.key replaced, and an OSError for a file, before
    (
        "keys-over-a-client-key",
        lambda c: ["keys", "--out", str(c.tmp), *_a_client_key(c)],
        "already holds client.key",
    ),
    ("keys-out-a-file", lambda c: ["keys", "--out", str(c.tmp / "a.txt"), *touch(c, "a.txt")], "is a file"),
    # thousands of idle producers forked, before
    (
        "producers-beyond-shards",
        ["run", "--producers", "100000"],
        "--producers 100000: more than the 16 shards",
    ),
    # the corpus, the tokenizer written over, before
    ("summary-json-over-the-corpus", lambda c: _over_the_corpus(c, "--summary-json"), "is the --data file"),
    ("doc-log-into-the-corpus", lambda c: _over_the_corpus(c, "--doc-log"), "is the --data file"),
    ("summary-json-over-the-tokenizer", lambda c: _over_the_tokenizer(c), "is the --tokenizer"),
    # an OSError naming prepare's temporary folder, before
    (
        "prepare-out-in-proc",
        ["prepare", "--data", "README.md", "--out", "/proc/lmpipe-shards"],
        "--out /proc/lmpipe-shards: nothing can be made in /proc",
    ),
    ("export-out-empty", lambda c: ["export", str(c.checkpoint), "--out", ""], "--out is required"),
    (
        "keys-out-empty",
        ["keys", "--out", ""],
        "--out: an empty value (an unset shell variable?); --out is required",
    ),
    # tokenizer train's --out: a traceback from tok.save after the training before
    (
        "tokenizer-out-a-folder",
        lambda c: ["tokenizer", "train", "--out", str(c.tmp)],
        "is a directory; name a file",
    ),
    (
        "tokenizer-out-in-missing-folder",
        lambda c: ["tokenizer", "train", "--out", str(c.tmp / "no" / "t.json")],
        f"{os.sep}no is not an existing directory",
    ),
    # "no text documents in shards" (every record "empty or malformed") before
    (
        "tokenizer-train-on-shards",
        lambda c: ["tokenizer", "train", "--data", str(c.shards), "--out", str(c.tmp / "t.json")],
        "--data must be corpus files (text, JSONL, Parquet, Arrow...), not a prepared shard directory",
    ),
    ("tokenizer-vocab-huge", ["tokenizer", "train", "--vocab-size", "1000000000"], "--vocab-size 1000000000"),
    # paths written only later (the first checkpoint, the summary): refused before any training
    (
        "checkpoint-dir-is-a-file",
        lambda c: ["run", "--checkpoint-dir", str(c.tmp / "f"), *touch(c, "f")],
        "--checkpoint-dir",
    ),
    (
        "checkpoint-dir-is-one-checkpoint",  # trained from step 0 and wrote inside the old checkpoint before
        lambda c: ["run", "--checkpoint-dir", str(c.checkpoint), "--resume", "auto"],
        "is one checkpoint; give the folder that holds it",
    ),
    ("summary-json-in-missing-folder", ["run", "--summary-json", "/nonexistent/s.json"], "--summary-json"),
    ("doc-log-is-a-folder", lambda c: ["train", "--doc-log", str(c.tmp)], "is a directory"),
    # the next run read the log as corpus, and could not resume: the corpus's fingerprint had changed
    (
        "doc-log-in-the-data-folder",
        lambda c: ["run", "--data", str(c.tmp), "--doc-log", str(c.tmp / "docs.jsonl"), *touch(c, "a.txt")],
        "is in the folder --data",
    ),
    (
        "doc-log-in-the-data-folder-given-as-a-file-url",
        lambda c: [
            "run",
            "--data",
            c.tmp.as_uri(),
            "--doc-log",
            str(c.tmp / "docs.jsonl"),
            *touch(c, "a.txt"),
        ],
        "is in the folder --data file://",
    ),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the default run, written without training (step 0)."""
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.trainer import Trainer
    from lmpipe.shared.config import PipelineConfig

    ck = tmp_path_factory.mktemp("ck")
    path = Trainer(PipelineConfig(), TrainConfig(checkpoint_dir=str(ck), metrics_port=-1)).save_checkpoint()
    assert path is not None
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A real shard set of a small corpus, prepared by the real command."""
    from lmpipe.producer import builtin_corpus

    d = tmp_path_factory.mktemp("shards")
    (d / "c.txt").write_text("\n\n".join(builtin_corpus.document(3, i) for i in range(40)) + "\n")
    with process_state():
        assert cli.main(["prepare", "--data", str(d / "c.txt"), "--out", str(d / "shards")]) == 0
    return d / "shards"


@pytest.mark.parametrize("name,argv,expect", CASES)
def test_usage_mistake_is_one_line_and_status_2(
    lmpipe, tmp_path, port, checkpoint, shards, name, argv, expect
):
    c = Ctx(tmp_path, port, checkpoint, shards)
    args = argv(c) if callable(argv) else argv
    if args[0] in ("run", "train", "produce") and "--port" not in args:
        args += ["--port", str(port)]  # never a port another test is using
    try:
        if args[0] in ("run", "train", "produce"):
            args += ["--metrics-port", "-1"]
        out = lmpipe(*args, env=c.env)
    finally:
        for held in c.hold:
            if isinstance(held, socket.socket):
                held.close()
            else:
                held.release()
    lines = out.stderr.splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    assert len(lines) == 1, out.stderr
    assert expect in lines[0], lines[0]


def test_export_over_an_earlier_export_says_so_and_a_failed_one_keeps_it(
    lmpipe, tmp_path, checkpoint, monkeypatch
):
    """export --out replaced a file without a word, and a failed write (a full disk) left a truncated one."""
    out = tmp_path / "m.safetensors"
    first = lmpipe("export", str(checkpoint), "--out", str(out))
    assert first.returncode == 0 and "replacing" not in first.stdout, first.stderr
    again = lmpipe("export", str(checkpoint), "--out", str(out))
    assert again.returncode == 0 and "replacing the file there" in again.stdout, again.stderr
    import safetensors.torch

    from lmpipe.consumer.checkpoint import export_safetensors

    kept = out.read_bytes()

    def disk_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_safetensors(checkpoint, out)
    assert out.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


@pytest.mark.parametrize("given", ["itself", "a-link-to-it", "its-folder-as-data"])
def test_tokenizer_train_refuses_to_write_over_its_corpus(lmpipe, tmp_path, given):
    """`tokenizer train --data X.txt --out X.txt` replaced the corpus with the tokenizer's JSON."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("A first document.\n\nA second one.\n")
    before = corpus.read_bytes()
    out = corpus
    data = tmp_path if given == "its-folder-as-data" else corpus
    if given == "a-link-to-it":
        out = tmp_path / "t.json"
        out.symlink_to(corpus)
    res = lmpipe("tokenizer", "train", "--data", str(data), "--out", str(out), "--vocab-size", "258")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr == (
        f"lmpipe tokenizer: --out {out} is the corpus file {corpus}: training would replace it; choose another --out\n"
    )
    assert corpus.read_bytes() == before


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_tokenizer_train_that_cannot_save_says_so_in_one_line(lmpipe, tmp_path):
    """Refused before the training (not writable by this user), or, where root may write /proc, by its
    save after it: one line either way, not a traceback from tok.save."""
    (tmp_path / "c.txt").write_text("A first document.\n\nA second one.\n")
    out = "/proc/lmpipe-test-tokenizer.json"
    res = lmpipe("tokenizer", "train", "--data", str(tmp_path / "c.txt"), "--out", out, "--vocab-size", "258")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    assert res.stderr.splitlines()[-1].startswith(f"lmpipe tokenizer: --out {out}: "), res.stderr


def test_an_existing_tokenizer_file_may_be_replaced(lmpipe, tmp_path):
    (tmp_path / "c.txt").write_text("A first document.\n\nA second one.\n")
    out = tmp_path / "t.json"
    out.write_text("an older tokenizer")
    res = lmpipe(
        "tokenizer", "train", "--data", str(tmp_path / "c.txt"), "--out", str(out), "--vocab-size", "258"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["model"]["type"] == "BPE"


@pytest.mark.parametrize("cmd", ["prepare", "tokenizer"])
def test_corpus_only_commands_do_not_offer_shards_in_help(lmpipe, cmd):
    """prepare and tokenizer train said --data took "a prepared shard directory; none: the built-in corpus"."""
    text = " ".join(lmpipe(cmd, "--help").stdout.split())
    assert "corpus files (text, JSONL" in text and "prepared shard directory" not in text
    assert ("none: the built-in corpus" in text) == (cmd == "tokenizer")  # prepare requires --data


# -- a value from LMPIPE_<FLAG> is named as that variable, in cross-field errors and later checks too ------
# (they named the flag, which the user never typed); a value from a flag is still named as the flag

FROM_THE_ENVIRONMENT = [
    (
        "run-fp8-on-cpu",
        {"LMPIPE_PRECISION": "fp8", "LMPIPE_DEVICE": "cpu"},
        ["run"],
        "lmpipe run: LMPIPE_PRECISION=fp8 needs a GPU with FP8 matmuls; LMPIPE_DEVICE=cpu is the CPU",
    ),
    (
        "train-fp8-variable-on-cpu-flag",
        {"LMPIPE_PRECISION": "fp8"},
        ["train", "--device", "cpu"],
        "lmpipe train: LMPIPE_PRECISION=fp8 needs a GPU with FP8 matmuls; --device cpu is the CPU",
    ),
    (
        "flags-win-and-are-named",
        {"LMPIPE_PRECISION": "bf16", "LMPIPE_ATTENTION": "dense", "LMPIPE_DEVICE": "cuda"},
        ["run", "--device", "cpu", "--attention", "flash"],
        "lmpipe run: --attention flash needs a CUDA GPU; --device cpu is the CPU",
    ),
    (
        "produce-rank-outside-world",
        {"LMPIPE_RANK": "2", "LMPIPE_WORLD_SIZE": "2"},
        ["produce"],
        "lmpipe produce: LMPIPE_RANK=2 must be below LMPIPE_WORLD_SIZE=2",
    ),
    (
        "produce-batch-too-large",
        {"LMPIPE_BATCH_SIZE": "100000000"},
        ["produce"],
        "lmpipe produce: LMPIPE_BATCH_SIZE=100000000 x --seq-len 128 is 12,800,000,000 tokens a batch",
    ),
    (
        "train-slots-below-accum",  # the advice's "--accum slots" is no value: it stays a flag
        {"LMPIPE_ACCUM": "4"},
        ["train", "--slots", "3"],
        "lmpipe train: --slots 3 is fewer than LMPIPE_ACCUM=4: a step holds --accum slots",
    ),
    (
        "train-resume-auto-without-dir",
        {"LMPIPE_RESUME": "auto"},
        ["train"],
        "lmpipe train: LMPIPE_RESUME=auto needs --checkpoint-dir",
    ),
    # checks after the settings are built (lmpipe/launch.py) name them the same way
    (
        "run-vocab-too-small",
        {"LMPIPE_VOCAB_SIZE": "10"},
        ["run"],
        "lmpipe run: LMPIPE_VOCAB_SIZE=10 is smaller than the tokenizer's",
    ),
    (
        "produce-worker-outside-producers",
        {"LMPIPE_WORKER": "2"},
        ["produce", "--producers", "2"],
        "lmpipe produce: LMPIPE_WORKER=2 must be below --producers 2",
    ),
    (
        "run-missing-corpus",
        {"LMPIPE_DATA": "/nonexistent.txt"},
        ["run"],
        "lmpipe run: LMPIPE_DATA: ",
    ),
]


@pytest.mark.parametrize("name,variables,argv,start", FROM_THE_ENVIRONMENT)
def test_a_value_from_the_environment_is_named_as_its_variable(lmpipe, port, name, variables, argv, start):
    out = lmpipe(*argv, "--port", str(port), "--metrics-port", "-1", env=variables)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(start), out.stderr


# -- ... also where the message names one path of LMPIPE_DATA, settings said together, or "this run has" --


def two_folders(c: Ctx) -> tuple[Path, Path]:
    """Two corpus folders, each with a text file."""
    out = []
    for name in ("one", "two"):
        (c.tmp / name).mkdir()
        (c.tmp / name / "a.txt").write_text(f"A document in {name}.\n")
        out.append(c.tmp / name)
    return out[0], out[1]


def doc_log_in_one_of_the_data_folders(c: Ctx) -> tuple[list[str], str]:
    one, two = two_folders(c)
    c.env["LMPIPE_DATA"] = f"{one} {two}"
    return ["run", "--doc-log", str(one / "docs.jsonl")], f"is in the folder {one} (in LMPIPE_DATA), where"


def doc_log_in_the_data_folder(c: Ctx) -> tuple[list[str], str]:
    one, _ = two_folders(c)
    c.env["LMPIPE_DATA"] = str(one)  # the whole list: named as the variable's value
    return ["run", "--doc-log", str(one / "docs.jsonl")], f"is in the folder LMPIPE_DATA={one}, where"


def shard_set_among_the_data(c: Ctx) -> tuple[list[str], str]:
    one, _ = two_folders(c)
    shards = c.tmp / "shards"  # what is_shard_dir looks for: meta.json and a shard file beside it
    shards.mkdir()
    (shards / "meta.json").write_text("{}")
    (shards / "tokens-0.bin").write_bytes(b"")
    c.env["LMPIPE_DATA"] = f"{one} {shards}"
    said = f"{shards} (in LMPIPE_DATA) is a shard set (lmpipe prepare): give it as the only --data"
    return ["produce"], said


def under_torchrun(rank: str | None, world: str) -> Callable[[Ctx], tuple[list[str], str]]:
    """`lmpipe train` as rank 0 of 2 under torchrun, with LMPIPE_WORLD_SIZE (and LMPIPE_RANK, or --rank)
    that disagree: the combined "--rank/--world-size 1/3" names each value's source."""

    def make(c: Ctx) -> tuple[list[str], str]:
        c.env.update(WORLD_SIZE="2", RANK="0", LMPIPE_WORLD_SIZE=world)
        said = f"LMPIPE_WORLD_SIZE={world} disagree with torchrun's 0/2"
        if rank is not None:
            c.env["LMPIPE_RANK"] = rank
            return ["train"], f"LMPIPE_RANK={rank} and {said}"
        return ["train", "--rank", "1"], f"--rank 1 and {said}"

    return make


def resume_with_another_doc_split(c: Ctx) -> tuple[list[str], str]:
    """A checkpoint (its header is all that is read before the run starts) of --doc-split blank on the same
    file, resumed with LMPIPE_DOC_SPLIT=line."""
    from lmpipe.producer.sources import Corpus

    one, _ = two_folders(c)
    data = str(one / "a.txt")
    ck = c.tmp / "ck"
    ck.mkdir()
    trained = Corpus([data], doc_split="blank").fingerprint()
    (ck / "header.json").write_text(json.dumps({"format_version": 1, "data": trained}))
    c.env["LMPIPE_DOC_SPLIT"] = "line"
    said = "was trained with --doc-split blank, this run has LMPIPE_DOC_SPLIT=line: resume with the same --doc-split"
    return ["run", "--data", data, "--resume", str(ck)], said


LATER_CHECKS = [
    doc_log_in_one_of_the_data_folders,
    doc_log_in_the_data_folder,
    shard_set_among_the_data,
    under_torchrun("1", "3"),
    under_torchrun(None, "3"),
    resume_with_another_doc_split,
]


@pytest.mark.parametrize(
    "make", LATER_CHECKS, ids=["doc-log-in-one-data-folder", "doc-log-in-the-data-folder", "shard-set-in-data",
                               "rank-and-world-size", "rank-flag-and-world-size", "resume-doc-split"]
)  # fmt: skip
def test_a_later_checks_message_names_the_variable_that_gave_the_value(lmpipe, tmp_path, port, make):
    """Said by a check after the settings were built (and by the producer's corpus, or consumer/config.py's
    per_rank under torchrun): the value the environment gave is named as its variable there too."""
    c = Ctx(tmp_path, port, tmp_path, tmp_path)
    argv, said = make(c)
    out = lmpipe(*argv, "--port", str(port), "--metrics-port", "-1", env=c.env)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert said in out.stderr, out.stderr


def test_producer_metrics_ports_past_65535_are_refused_up_front(lmpipe, port):
    """Producer i serves metrics on --metrics-port + 1 + i: each failed in bind() with a traceback, and the
    run stopped with 'producer 0 exited with code 1'."""
    out = lmpipe("run", "--metrics-port", "65535", "--port", str(port))
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "lmpipe run: --metrics-port 65535: its 2 producers would serve on ports up to 65537, past 65535; give a "
        "lower --metrics-port (0: any free port, -1: off)"
    ], out.stderr


def test_a_vocabulary_smaller_than_asked_is_said(lmpipe, tmp_path):
    """Without --data the built-in corpus gave 1,101 tokens of the 4,096 asked for, and nothing said so."""
    (tmp_path / "c.txt").write_text("A first document.\n\nA second one.\n")
    out = tmp_path / "t.json"
    res = lmpipe(
        "tokenizer", "train", "--data", str(tmp_path / "c.txt"), "--out", str(out), "--vocab-size", "400"
    )
    assert res.returncode == 0, res.stderr
    have = json.loads(out.read_text())["model"]["vocab"]
    assert res.stderr.splitlines()[-1] == (
        f"note: {len(have)} tokens, not the 400 asked for: the corpus has too little text for more merges (give "
        "more --data for a larger vocabulary)"
    )


@pytest.mark.parametrize(
    "pipeline, train, expect",
    [
        ({"pad_multiple": 64}, {}, "--pad-multiple 64 has no effect with --strategy pack"),
        ({"pad_multiple": 64, "strategy": "pad"}, {}, "--pad-multiple 64 has no effect with --strategy pad"),
        ({"pad_multiple": 128, "strategy": "bucket"}, {}, "--pad-multiple 128 is not below --seq-len 128"),
        ({}, {"warmup": 50, "steps": 20}, "--warmup 50 is not below --steps 20: the learning rate never"),
        ({"pad_multiple": 64, "strategy": "pad-batch"}, {"warmup": 5, "steps": 20}, None),
        ({}, {"warmup": 50, "steps": 0}, None),  # no end: the warmup ends
        ({}, {"warmup": 50, "steps": 20, "consume_only": True}, None),  # nothing trained
    ],
)
def test_a_setting_that_changes_nothing_is_said(pipeline, train, expect, caplog):
    """Accepted without a word, these read as changing the run and do not (or not as they read)."""
    from lmpipe.consumer.config import TrainConfig
    from lmpipe.launch import say_no_effect

    with caplog.at_level("WARNING", logger="lmpipe"):
        say_no_effect(PipelineConfig(**pipeline), TrainConfig(**train))
    lines = [r.getMessage() for r in caplog.records]
    if expect is None:
        assert lines == []
    else:
        assert len(lines) == 1 and expect in lines[0], lines
