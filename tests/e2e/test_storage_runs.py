"""Issue 44, with a real trainer and producers on moto's S3 server (tests/s3server.py, its own process):
a resume refused after objects were rewritten with the same size names them (a few, then "and N more"),
and an outage of the store's reads, through the fault-injecting proxy (tests/faultproxy.py), shows both as
the producer's storage wait and as the trainer's data wait, with every document still trained once."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from lmpipe.checks import check_resume_corpus
from lmpipe.consumer.checkpoint import CheckpointManager
from lmpipe.consumer.config import TrainConfig
from lmpipe.producer import builtin_corpus, remote
from lmpipe.producer.sources import Corpus
from lmpipe.shared.settings import SettingsError
from tests.corpora import token_lengths
from tests.faultproxy import FaultProxy
from tests.helpers import assert_exactly_once, free_ports, lmpipe_env, read_doc_log, small_run
from tests.s3server import S3Server

PARTS = 6  # objects of s3://named/parts/, one line a document
DOCS = 60  # documents of s3://outage/


def _doc(k: int, i: int) -> str:
    return " ".join(builtin_corpus.document(k, i).split()[:30])


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3")
    (root / "named" / "parts").mkdir(parents=True)
    for k in range(PARTS):
        (root / "named" / "parts" / f"p{k}.txt").write_text("".join(_doc(k, i) + "\n" for i in range(30)))
    (root / "outage").mkdir()  # two documents in a.jsonl (less than a batch), the rest in b.jsonl
    for name, ids in (("a", range(2)), ("b", range(2, DOCS))):
        lines = "".join(json.dumps({"text": _doc(9, i)}) + "\n" for i in ids)
        (root / "outage" / f"{name}.jsonl").write_text(lines)
    server = S3Server(root, tmp_path_factory.mktemp("s3log") / "server.log")
    server.start()
    port = server.port
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:  # this process reads and rewrites objects too
        for k, v in {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            mp.setenv(k, v)
        _fresh_filesystems()
        yield port, env
    server.kill()
    _fresh_filesystems()


def _fresh_filesystems() -> None:
    """No filesystem cached for another endpoint (an earlier test's server or proxy)."""
    import fsspec

    remote.filesystem.cache_clear()
    fsspec.filesystem("s3").clear_instance_cache()
    remote.filesystem.cache_clear()


def _rewrite(key: str) -> None:
    """The object again with the same size and other bytes (one letter other): same name, same size."""
    fs = remote.filesystem("s3")
    body = bytearray(fs.cat_file(key))
    at = body.index(b"e")
    body[at : at + 1] = b"E"
    fs.pipe(key, bytes(body))
    fs.invalidate_cache()


def test_a_refused_resume_names_the_rewritten_objects(procs, s3, tmp_path, port):
    """The checkpoint keeps each object's version (header `data_objects`), and a resume on unchanged
    objects keeps it on: after one object is rewritten with the same size, `--resume` refuses in one line that names that object and no other; after five,
    it names three and counts the rest. A checkpoint without the field (older lmpipe) keeps the refusal
    that names none."""
    s3_port, aws = s3
    url, ck = "s3://named/parts/", tmp_path / "ck"
    env = {**lmpipe_env(), **aws, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}"}
    flags = small_run(port, data=url, doc_split="line", seq_len=64, batch_size=4, producers=1, threads=1,
                      checkpoint_dir=ck)  # fmt: skip
    r = procs.start("run", *flags, "--steps", "2", env=env, name="make")
    assert procs.wait(r, timeout=180) == 0, procs.log(r)[-3000:]
    header = json.loads((CheckpointManager(ck).latest() / "header.json").read_text())
    assert header["data_objects"] == Corpus([url]).object_versions() and len(header["data_objects"]) == 1
    r = procs.start(
        "run", *flags, "--steps", "3", "--resume", "auto", env=env, name="same"
    )  # nothing changed
    assert procs.wait(r, timeout=180) == 0, procs.log(r)[-3000:]
    header = json.loads((CheckpointManager(ck).latest() / "header.json").read_text())
    assert header["step"] == 3 and header["data_objects"] == Corpus([url]).object_versions(), "kept on"

    _rewrite("named/parts/p3.txt")
    p = procs.start("run", *flags, "--steps", "5", "--resume", "auto", env=env, name="changed")
    assert procs.wait(p, timeout=120) == 2, procs.log(p)[-3000:]
    last = [line for line in procs.log(p).splitlines() if line.strip()][-1]
    assert "their versions in the store changed since it was written (rewritten: 's3://named/parts/p3.txt'): " \
           "its cursors would not follow" in last, last  # fmt: skip
    assert "Traceback" not in procs.log(p)

    for k in (0, 1, 4, 5):
        _rewrite(f"named/parts/p{k}.txt")
    resume = TrainConfig(resume="auto", checkpoint_dir=str(ck))
    with pytest.raises(SettingsError) as err:
        check_resume_corpus(Corpus([url], doc_split="line"), resume)
    named = "'s3://named/parts/p0.txt', 's3://named/parts/p1.txt', 's3://named/parts/p3.txt' and 2 more"
    assert f"(rewritten: {named}): its cursors" in str(err.value), err.value
    assert "\n" not in str(err.value)

    hdr = CheckpointManager(ck).latest() / "header.json"  # as lmpipe wrote it before data_objects
    hdr.write_text(json.dumps({k: v for k, v in header.items() if k != "data_objects"}))
    with pytest.raises(SettingsError) as err:
        check_resume_corpus(Corpus([url], doc_split="line"), resume)
    assert "their versions in the store changed since it was written: its cursors" in str(err.value)


def _storage_wait(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(v) for v in re.findall(r"(?m)^lmpipe_producer_storage_wait_seconds_total\S* (\S+)$", text)
    )


def test_a_storage_outage_shows_as_storage_wait_and_as_data_wait(procs, s3, tmp_path, port, tok):
    """The store stops answering reads of the second object (listings, HEADs and the first object still
    answered) until the producer, connected and reading, has logged its second retry: its storage-wait
    metric holds its retry sleeps; the trainer, waiting since before the producer started (the first object
    holds less than a batch), counts at least those sleeps as its wait for the first batch; and the epoch
    still trains every document exactly once."""
    s3_port, aws = s3
    docs, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    common = [
        "--port",
        str(port),
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--producers",
        "1",
    ]
    with FaultProxy(s3_port) as proxy:
        proxy.reads_down = "/outage/b.jsonl"
        t = procs.start("train", *common, *small_run(None, steps=0, threads=1, doc_log=docs, summary_json=summary),
                        name="trainer")  # fmt: skip
        procs.wait_for(t, "listening on", 120)
        mp = free_ports(1)
        env = {**lmpipe_env(), **aws, "AWS_ENDPOINT_URL": proxy.endpoint}
        p = procs.start("produce", *common, "--data", "s3://outage/", "--metrics-port", str(mp),
                        env=env, name="producer")  # fmt: skip
        procs.wait_for(p, "retry 2/7", 120)
        waited = _storage_wait(mp)  # while it sleeps before its third attempt
        proxy.reads_down = ""
        assert procs.wait(t, 180) == 0, procs.log(t)[-3000:]
    sleeps = [float(s) for s in re.findall(r"; retry \d+/7 in ([0-9.]+) s", procs.log(p))]
    assert sleeps[:2] == [0.5, 1.0], procs.log(p)[-3000:]
    assert waited >= sleeps[0], (waited, sleeps)  # the first sleep is over; it counts as storage wait
    got = json.loads(summary.read_text())
    assert got["stopped_by"] == "end of data" and got["rejected"] == 0, got
    assert got["first_data_wait_seconds"] >= sum(sleeps), (got, sleeps)
    assert_exactly_once(read_doc_log(docs), token_lengths(tok, {i: _doc(9, i) for i in range(DOCS)}))
