"""Corpora and shards on object storage, against a real S3-compatible server on loopback (moto's, in its
own process): the same records as local files, bounded memory, a permanent error stopped at once with one
line, and a server killed and restarted mid-epoch retried with every document still trained exactly once."""

from __future__ import annotations

import io
import json
import re
import shutil
import time
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest

from lmpipe.producer import remote
from lmpipe.producer.formats import CorpusChanged
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from tests.corpora import FORMATS, builtin_docs, token_lengths, write, write_finetune_corpus
from tests.helpers import (
    assert_exactly_once,
    lmpipe_env,
    read_doc_log,
    steps_logged,
    wait_until,
)
from tests.s3server import S3Server

BUCKET = "corpora"
MIXED = ("jsonl.gz", "jsonl.zst", "parquet", "arrow-file")  # one file each in s3://corpora/mixed/, then hf/


def short_docs(n: int) -> list[str | None]:
    """Short documents (about 25 tokens): many records, so the producer reads its files chunk after chunk
    (512 records at a time) through the epoch."""
    return [" ".join(d.split()[:20]) for d in builtin_docs(n)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3")
    local = tmp_path_factory.mktemp("local")
    b = root / BUCKET
    # every format, one file each, for record-by-record comparison with the local copies
    docs = builtin_docs(200)
    docs[3], docs[150] = None, None
    for fmt in FORMATS:
        path = write(local / "each" / fmt.replace(".", "-"), docs, fmt, rows_per_group=32)
        target = b / "each" / path.name if fmt != "hf" else b / "each" / "hf"
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if path.is_dir() else shutil.copy)(path, target)
    # the restart test's corpus: 4 files of mixed formats and a HF folder, 2000 short documents each: about
    # 250k tokens, well beyond what the sockets between producer and trainer buffer (so the producer is
    # still reading when the server dies)
    mixed = short_docs(10_000)
    for i in (12, 4500, 8321):
        mixed[i] = None
    for k, fmt in enumerate(MIXED):
        write(b / "mixed" / f"part{k}", mixed[2000 * k : 2000 * (k + 1)], fmt, rows_per_group=500)
    write(b / "hf", mixed[8000:], "hf", rows_per_group=500)
    # shards prepared from 300 ordinary documents
    shard_docs = builtin_docs(300)
    src = write(local / "shard-src", shard_docs, "jsonl")
    from lmpipe.producer.shards import prepare

    tok_stream = DocStream(Corpus([str(src)]), _tok(), shuffle_window=0)
    prepare(tok_stream, local / "shards", progress=False)
    shutil.copytree(local / "shards", b / "shards")
    # shards with loss masks (plain shards first, then masked ones), for the masks read by ranged reads
    write_finetune_corpus(local / "ft.jsonl", n=160, seed=2, plain_head=300)
    prepare(DocStream(Corpus([str(local / "ft.jsonl")]), _tok(), shuffle_window=0), local / "masked",
            shard_tokens=2000, progress=False)  # fmt: skip
    shutil.copytree(local / "masked", b / "masked")
    # large objects for the memory test: 48 MiB of text, as zstd JSONL and as Parquet with 1 MiB row groups
    big = _big_docs(48 << 20)
    write(b / "big" / "text", big, "jsonl.zst")
    write(b / "big" / "text", big, "parquet", rows_per_group=1000)
    server = S3Server(root, tmp_path_factory.mktemp("s3log") / "server.log")
    server.start()
    server.docs = {"each": docs, "mixed": mixed, "shards": shard_docs, "big": len(big)}  # type: ignore[attr-defined]
    server.local = local  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        remote.filesystem.cache_clear()
        yield server
    server.kill()
    remote.filesystem.cache_clear()


def _tok():
    from lmpipe.shared.tokenizer import load_tokenizer

    return load_tokenizer()


def _big_docs(nbytes: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = np.array(["the", "of", "a", "to", "in", "harbour", "river", "market", "garden", "report", "mill"])
    per_doc = 170  # about 1 KiB a document
    n = nbytes // (per_doc * 6)
    flat = words[rng.integers(0, len(words), size=n * per_doc)].reshape(n, per_doc)
    return [" ".join(row) for row in flat]


def records(url: str, worker: int = 0, num_workers: int = 1):
    return [(r.rid, r.text, r.bad and r.bad[0]) for r in Corpus([url]).records(worker, num_workers)]


def test_remote_files_give_the_records_and_fingerprint_of_local_ones(s3):
    local = s3.local / "each"
    for fmt in FORMATS:
        name = fmt.replace(".", "-")
        path = next(local.glob(name + "*"))
        url = f"s3://{BUCKET}/each/{path.name}" if fmt != "hf" else f"s3://{BUCKET}/each/hf"
        for w in range(2):
            assert records(url, w, 2) == records(str(path), w, 2), fmt
        assert Corpus([url]).fingerprint() == Corpus([str(path)]).fingerprint(), fmt
    bad = [r for r in Corpus([f"s3://{BUCKET}/each/parquet.parquet"]).records() if r.bad]
    assert [r.where for r in bad] == [f"s3://{BUCKET}/each/parquet.parquet:row {i}" for i in (3, 150)]
    # a prefix stands for its corpus files, a glob for its matches
    folder = Corpus([f"s3://{BUCKET}/each/"])
    assert [f.name for f in folder.paths] == [
        "arrow-file.arrow", "arrow.arrow", "jsonl-gz.jsonl.gz", "jsonl-zst.jsonl.zst", "jsonl.jsonl", "parquet.parquet"
    ]  # fmt: skip
    assert [f.fmt for f in Corpus([f"s3://{BUCKET}/each/*.jsonl*"]).paths] == ["jsonl"] * 3


def test_prepare_reads_object_storage(s3, tmp_path):
    from lmpipe.cli import main

    out = {}
    for name, data in (("remote", [f"s3://{BUCKET}/mixed", f"s3://{BUCKET}/hf"]),
                       ("local", [str(s3.root / BUCKET / "mixed"), str(s3.root / BUCKET / "hf")])):  # fmt: skip
        assert main(["prepare", "--data", *data, "--out", str(tmp_path / name)]) == 0
        out[name] = [(tmp_path / name / f).read_bytes() for f in ("tokens-00000.bin", "rids-00000.bin")]
    assert out["remote"] == out["local"] and len(out["local"][1]) == 8 * (10_000 - 3)


def test_a_cursor_names_the_same_documents_when_remote_objects_are_read_again(s3):
    """Resuming at a position re-opens the objects, reads them from the start and skips: the documents
    from there on are the uninterrupted stream's, and the local files'."""
    tok = _tok()
    urls = [f"s3://{BUCKET}/mixed", f"s3://{BUCKET}/hf"]
    local = [str(s3.root / BUCKET / "mixed"), str(s3.root / BUCKET / "hf")]

    def docs(paths, w, start):
        stream = DocStream(Corpus(paths), tok, w, 2, seed=7, shuffle_window=256)
        return [(d.pos, d.doc_id, d.ids.tolist()) for d in stream.docs(1, start)]

    for w in range(2):
        full = docs(urls, w, 0)
        assert len(full) > 4000 and full == docs(local, w, 0)
        assert docs(urls, w, 1234) == full[1234:]


def test_remote_shards_serve_the_documents_of_local_ones(s3):
    tok = _tok()
    url = f"s3://{BUCKET}/shards"
    rc, lc = Corpus([url]), Corpus([str(s3.local / "shards")])
    assert rc.shards is not None and rc.fingerprint() == lc.fingerprint()
    for epoch, start in ((0, 0), (3, 41)):
        for w in range(2):
            a = [
                (d.pos, d.doc_id, d.ids.tolist()) for d in DocStream(rc, tok, w, 2, seed=5).docs(epoch, start)
            ]
            b = [
                (d.pos, d.doc_id, d.ids.tolist()) for d in DocStream(lc, tok, w, 2, seed=5).docs(epoch, start)
            ]
            assert a == b and len(a) == 150 - start


def test_remote_shards_serve_the_loss_masks_of_local_ones(s3):
    tok = _tok()
    rc, lc = Corpus([f"s3://{BUCKET}/masked"]), Corpus([str(s3.local / "masked")])
    assert rc.shards is not None and lc.shards is not None
    assert any("mask" in sh["files"] for sh in rc.shards.meta["shards"])

    def docs(corpus, w):
        return [(d.doc_id, d.ids.tolist(), None if d.mask is None else d.mask.tolist())
                for d in DocStream(corpus, tok, w, 2, seed=5).docs(0)]  # fmt: skip

    for w in range(2):
        a = docs(rc, w)
        assert a == docs(lc, w)
        assert any(m is None for _, _, m in a) and any(m is not None and 0 in m for _, _, m in a)


def test_remote_reads_hold_bounded_memory(s3):
    """48 MiB of text streamed through 4 MiB reads: neither Python nor Arrow holds more than a few blocks."""
    for name in ("text.jsonl.zst", "text.parquet"):
        pa_peak = n = bad = 0
        tracemalloc.start()
        try:
            for rec in Corpus([f"s3://{BUCKET}/big/{name}"]).records():
                n += 1
                bad += rec.bad is not None
                if n % 500 == 0:
                    pa_peak = max(pa_peak, pa.total_allocated_bytes())
            py_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert bad == 0 and n == s3.docs["big"]
        assert py_peak < 24 << 20, f"{name}: Python peak {py_peak / 2**20:.1f} MiB"
        assert pa_peak < 16 << 20, f"{name}: Arrow peak {pa_peak / 2**20:.1f} MiB"


def test_a_missing_bucket_stops_the_producer_at_once_with_one_line(procs, s3, port):
    env = {**lmpipe_env(), **s3.env()}
    t0 = time.monotonic()
    p = procs.start("produce", "--data", "s3://no-such-bucket/corpus", "--port", str(port), "--worker", "0",
                    "--metrics-port", "-1", env=env, name="producer")  # fmt: skip
    assert p.wait(timeout=60) == 2
    assert time.monotonic() - t0 < 30
    text = procs.log(p)
    assert "Traceback" not in text and "retry" not in text
    assert (
        "s3://no-such-bucket/corpus: not found (The specified bucket does not exist)" in text.splitlines()[-1]
    )


def test_retries_are_bounded_and_end_in_one_line(s3, monkeypatch, caplog):
    RETRIES, BACKOFF = remote.RETRIES, remote.BACKOFF  # noqa: N806 - the module's defaults
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF", 0.05)
    url = f"s3://{BUCKET}/each/parquet.parquet"
    s3.kill()
    try:
        t0 = time.monotonic()
        with pytest.raises(remote.RemoteError) as err:
            records(url)  # listings may come from s3fs's cache; reading the object cannot
        assert time.monotonic() - t0 < 20
    finally:
        s3.start()
    assert re.match(rf"{url}( bytes \d+-\d+)?: still failing after 2 retries over ", str(err.value)), (
        err.value
    )
    assert "EndpointConnectionError" in str(err.value) and "\n" not in str(err.value)
    retried = [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]
    assert [m.split("; ")[-1] for m in retried] == ["retry 1/2 in 0.1 s", "retry 2/2 in 0.1 s"]
    # the restarted server serves the same objects (read with the default policy: its socket may open a
    # moment after it says ready, which s3fs's own hidden retries used to cover)
    monkeypatch.setattr(remote, "RETRIES", RETRIES)
    monkeypatch.setattr(remote, "BACKOFF", BACKOFF)
    assert len(records(url)) == 200


@pytest.mark.slow
def test_server_restart_mid_epoch_is_retried_and_every_document_trained_once(procs, s3, tmp_path, port):
    """kill -9 of the S3 server while a producer streams six objects of four formats; restarted on the same
    port, the producer's retries go through and the epoch accounts for every document exactly once."""
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", f"s3://{BUCKET}/mixed", f"s3://{BUCKET}/hf", "--epochs", "1", "--steps", "0",
        "--producers", "1", "--shuffle-window", "256", "--port", str(port),
        "--metrics-port", "-1", "--log-every", "5", "--doc-log", str(log), "--summary-json", str(summary),
        "--threads", "1", env={**lmpipe_env(), **s3.env()}, name="run",
    )  # fmt: skip
    procs.wait_for(p, "step 5 ", timeout=120)
    s3.kill()
    procs.wait_for(p, "retry 1/", timeout=120)  # a producer's read found the server gone
    s3.start()
    assert p.wait(timeout=240) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0 and out["stale"] == 0
    good = {i: d for i, d in enumerate(s3.docs["mixed"]) if d is not None}
    assert_exactly_once(read_doc_log(log), token_lengths(_tok(), good))
    text = procs.log(p)
    retries = [line for line in text.splitlines() if "; retry " in line]
    assert retries and all(f"s3://{BUCKET}/" in line for line in retries), retries
    assert "still failing" not in text
    assert f"s3://{BUCKET}/mixed/part2.parquet:row 500: text is null" in text  # record 4500
    assert f"s3://{BUCKET}/hf/data-00000-of-00002.arrow:row 321: text is null" in text  # record 8321


@pytest.mark.slow
def test_remote_shards_train_every_document_exactly_once(procs, s3, tmp_path, port):
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    p = procs.start(
        "run", "--data", f"s3://{BUCKET}/shards", "--epochs", "1", "--steps", "0", "--port", str(port),
        "--metrics-port", "-1", "--log-every", "20", "--doc-log", str(log), "--summary-json", str(summary),
        "--threads", "1", env={**lmpipe_env(), **s3.env()}, name="run",
    )  # fmt: skip
    assert p.wait(timeout=240) == 0, procs.log(p)
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0
    assert_exactly_once(read_doc_log(log), token_lengths(_tok(), dict(enumerate(s3.docs["shards"]))))


def _versioned_object(name: str, body: bytes, bucket: str = BUCKET) -> str:
    """Writes s3://<bucket>/versions/<name> (a new version of it, if it was there) and returns its URL."""
    fs = remote.filesystem("s3")
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.pipe(f"{bucket}/versions/{name}", body)
    fs.invalidate_cache()  # the next listing asks the server, as a producer started later would
    return f"s3://{bucket}/versions/{name}"


def _one_byte_other(body: bytes) -> bytes:
    changed = bytearray(body)
    changed[len(changed) // 2] ^= 1
    return bytes(changed)


def test_a_remote_corpus_names_its_objects_versions(s3, tmp_path):
    """A corpus of objects has a `data_versions` from the versions its store reports (S3's ETag), scoped to
    those objects' URLs: a rewritten object of the same name and size is told apart without reading it, and
    a copy in another bucket is another location, never compared (its ETag may differ for the same bytes)."""
    from lmpipe.shared.messages import version_location

    body = b"".join(b"document %d of the corpus\n\n" % i for i in range(400))
    url = _versioned_object("digest.txt", body)
    first = Corpus([url]).version_digest()
    assert first and first == Corpus([url]).version_digest()
    _versioned_object("digest.txt", _one_byte_other(body))
    second = Corpus([url]).version_digest()
    assert second != first and version_location(second) == version_location(first), "same objects, rewritten"
    copy = Corpus([_versioned_object("digest.txt", body, bucket="copies")]).version_digest()
    assert version_location(copy) != version_location(first), "another bucket: other objects"
    local = tmp_path / "digest.txt"
    local.write_bytes(body)
    assert Corpus([str(local)]).version_digest() == "" and Corpus([str(local)]).content_digest()
    assert Corpus([str(local), url]).version_digest() == "", "local and remote mixed: not checked"
    assert Corpus([url]).content_digest() == "", "a store's version is not a content digest"
    # one object reached as a single URL (another spelling of the protocol), a folder, a glob: one location
    one = _versioned_object("a.txt", body, bucket="spelled")
    spellings = [one.replace("s3://", "s3a://"), "s3://spelled/versions/", "s3://spelled/versions/*.txt", one]
    assert len({Corpus([u]).version_digest() for u in spellings}) == 1


@pytest.mark.slow
def test_rewritten_objects_and_rewritten_files_are_both_refused_in_one_run(procs, s3, tmp_path, port):
    """The trainer's --data is a bucket object (its version pinned); producers read it there or from a local
    copy. After the object is rewritten with the same size, a producer reading it is refused, naming the
    versions; a local copy whose bytes differ from the first local producer's is still refused by content;
    the producer that was reading the object stops at its next pass, in one line; the trainer and the local
    copy's producer go on."""
    from lmpipe.producer import builtin_corpus

    text = "\n\n".join(builtin_corpus.document(1, i) for i in range(300)).encode()
    url = _versioned_object("corpus.txt", text)
    same, other = tmp_path / "same", tmp_path / "other"
    for d, body in ((same, text), (other, _one_byte_other(text))):
        d.mkdir()
        (d / "corpus.txt").write_bytes(body)
    env = {**lmpipe_env(), **s3.env()}
    log = tmp_path / "docs.jsonl"
    common = ["--port", str(port), "--epochs", "0", "--seq-len", "64", "--batch-size", "4", "--metrics-port",
              "-1"]  # fmt: skip
    t = procs.start("train", *common, "--data", url, "--producers", "1", "--shards", "4", "--steps", "0",
                    "--threads", "1", "--doc-log", str(log), env=env, name="trainer")  # fmt: skip
    p0 = procs.start("produce", *common, "--data", url, env=env, name="p0")
    wait_until(lambda: steps_logged(log) >= 2, 90, "steps with the first producer")
    p1 = procs.start("produce", *common, "--data", str(same / "corpus.txt"), env=env, name="local")
    wait_until(lambda: procs.log(t).count("joined from") >= 2, 60, "the producer of the local copy joins")

    _versioned_object("corpus.txt", _one_byte_other(text))
    versions = "data_versions: the producer's corpus objects have the same names and sizes but other versions"
    late = procs.start("produce", *common, "--data", url, env=env, name="late")
    assert procs.wait(late, 60) == 2, procs.log(late)[-3000:]
    assert f"trainer refused this producer: config mismatch: {versions}" in procs.log(late)
    content = "data_content: the producer's corpus files have the same names and sizes but other content"
    bad = procs.start("produce", *common, "--data", str(other / "corpus.txt"), env=env, name="bad")
    assert procs.wait(bad, 60) == 2, procs.log(bad)[-3000:]
    assert f"trainer refused this producer: config mismatch: {content}" in procs.log(bad)
    assert t.poll() is None and p1.poll() is None, "refused producers take nothing down"
    # the producer that was reading the object stops at its next pass: what it would serve is not the run's
    assert procs.wait(p0, 60) == 2, procs.log(p0)[-3000:]
    assert f"corpus object {url} changed during the run (rewritten: ETag=" in procs.log(p0)
    assert t.poll() is None and p1.poll() is None, "the trainer and the local copy's producer go on"


def test_an_object_rewritten_during_the_run_stops_its_reading_in_one_line(s3):
    """Each pass over an object starts and ends by asking its store for its version and size (a HEAD): a
    rewrite (same size, one byte other), a new size or a delete stop the reading with one line naming the
    object, where before the next pass served other text under the run's record ids. The same bytes put
    back (the same ETag) read on."""
    body = b"".join(b"document %d of the corpus\n\n" % i for i in range(400))
    url = _versioned_object("live.txt", body)
    c = Corpus([url])
    first = [(r.rid, r.text) for r in c.records()]
    _versioned_object("live.txt", body)  # uploaded again, unchanged
    assert [(r.rid, r.text) for r in c.records()] == first
    _versioned_object("live.txt", _one_byte_other(body))
    with pytest.raises(CorpusChanged, match=rf"^corpus object {re.escape(url)} changed during the run \(rewritten: "
                       r"ETag=[0-9a-f]{32} -> ETag=[0-9a-f]{32}\); .* restore it or start a new run$"):  # fmt: skip
        list(c.records())
    # during a pass: said at its end, before the next pass reads a byte of it
    mid = Corpus([_versioned_object("mid.parquet", _parquet_bytes([f"row {i}" for i in range(150)]))])
    it = mid.records()
    next(it)
    _versioned_object("mid.parquet", _parquet_bytes([f"row {i}" for i in range(180)]))
    with pytest.raises(CorpusChanged, match=r"changed during the run \([0-9,]+ -> [0-9,]+ bytes\)"):
        list(it)
    # many objects: all asked about at the pass's start, together, before any of them is read
    urls = [_versioned_object(f"many/{i}.txt", body) for i in range(5)]
    many = Corpus([f"s3://{BUCKET}/versions/many/"])
    assert [str(f) for f in many.paths] == urls
    assert len(list(many.records())) == 5 * len(first)
    _versioned_object("many/4.txt", _one_byte_other(body))
    it = many.records()
    with pytest.raises(CorpusChanged, match=rf"^corpus object {re.escape(urls[4])} changed during the run"):
        next(it)  # not a record of the first four objects first
    gone = Corpus([_versioned_object("gone.txt", body)])
    remote.filesystem("s3").rm(f"{BUCKET}/versions/gone.txt")
    with pytest.raises(CorpusChanged, match=r"changed during the run \(deleted\)"):
        list(gone.records())


def _parquet_bytes(texts: list[str]) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf)
    return buf.getvalue()


@pytest.mark.slow
def test_resume_refuses_a_bucket_object_rewritten_since_the_checkpoint(procs, s3, tmp_path, port):
    """The checkpoint keeps the remote objects' versions beside `data`: after a same-size rewrite of the
    object, a resume says so in one line, where before it resumed onto other document boundaries."""
    import json

    from lmpipe.consumer.checkpoint import CheckpointManager
    from lmpipe.producer import builtin_corpus

    text = "\n".join(builtin_corpus.document(2, i).replace("\n", " ") for i in range(200)).encode()
    url, ck = _versioned_object("resume.txt", text), tmp_path / "ck"
    env = {**lmpipe_env(), **s3.env()}
    base = ["--port", str(port), "--doc-split", "line", "--seq-len", "64", "--batch-size", "4", "--metrics-port",
            "-1", "--producers", "1", "--threads", "1", "--checkpoint-dir", str(ck), "--data", url]  # fmt: skip
    r = procs.start("run", *base, "--steps", "3", env=env, name="make")
    assert procs.wait(r, timeout=120) == 0, procs.log(r)
    header = json.loads((CheckpointManager(ck).latest() / "header.json").read_text())
    assert [v.partition(":")[0] for v in header["data_versions"]] == [Corpus([url]).version_digest()[:16]]
    _versioned_object("resume.txt", _one_byte_other(text))
    p = procs.start("run", *base, "--steps", "6", "--resume", "auto", env=env, name="changed")
    assert procs.wait(p, timeout=60) == 2, procs.log(p)
    last = [line for line in procs.log(p).splitlines() if line.strip()][-1]
    assert "their versions in the store changed since it was written" in last, procs.log(p)[-2000:]
    assert "Traceback" not in procs.log(p)
