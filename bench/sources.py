"""Producer throughput from each corpus source, against plain text, on the same documents.

    python -m bench.sources                      # WikiText-2 valid, pack, T=1024, 16 rows

WikiText-2 valid's documents (blank-line paragraphs of valid.txt) are written once, in a temporary folder,
as every source lmpipe reads: JSONL, gzip and zstd JSONL, Parquet, a Hugging Face save_to_disk folder,
prepared shards, and the text, zstd JSONL, Parquet, HF and shard copies on an S3 server (moto's, on
loopback: this measures the client's and the protocol's cost, not a network's latency). Each measurement
is the producer's whole path for one worker (read, decompress/decode, tokenize, shuffle, pack into
batches), no sockets, one epoch after another for at least --seconds (the corpus is opened once, its
files read again every epoch, as in a producer). Sources take turns in rounds, so a busy machine
slows them alike; the ratio is the median over rounds of (source tokens/s) / (plain text tokens/s in
the same round). Writes bench/results/sources-<date>.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import WIKITEXT, free_port_pair, table, write_result
from lmpipe.producer.shards import _RemoteShards

REMOTE = ("text", "jsonl.zst", "parquet", "hf", "shards")
PER_DOC = "s3 shards, a request per document"

MERGE_GAP = _RemoteShards.MERGE_GAP  # restored after the per-document measurement


def _build(work: Path, tok_path: str) -> tuple[dict[str, str], dict]:
    """Every local source of the same documents: name -> path, and the shards' meta.json."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from lmpipe.producer.shards import prepare
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream
    from lmpipe.shared.tokenizer import load_tokenizer

    src = WIKITEXT / "valid.txt"
    texts = [r.text for r in Corpus([str(src)]).records() if r.bad is None]
    out = {"text": str(work / "valid.txt")}
    shutil.copy(src, out["text"])
    jsonl = ("\n".join(json.dumps({"text": t}) for t in texts) + "\n").encode()
    for name, data in (
        ("jsonl", jsonl),
        ("jsonl.gz", gzip.compress(jsonl, 6)),
        ("jsonl.zst", zstandard.ZstdCompressor(level=3).compress(jsonl)),
    ):
        out[name] = str(work / f"valid.{name}")
        Path(out[name]).write_bytes(data)
    table_ = pa.table({"text": texts})
    out["parquet"] = str(work / "valid.parquet")
    pq.write_table(table_, out["parquet"], row_group_size=1000)
    hf = work / "valid-hf"
    hf.mkdir()
    bounds = np.linspace(0, len(texts), 3).astype(int)
    names = [f"data-{k:05d}-of-00002.arrow" for k in range(2)]
    for k, name in enumerate(names):
        part = table_.slice(bounds[k], bounds[k + 1] - bounds[k])
        with pa.OSFile(str(hf / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            for batch in part.to_batches(max_chunksize=1000):
                w.write_batch(batch)
    (hf / "dataset_info.json").write_text(
        json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}})
    )
    (hf / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_split": "validation"})
    )
    out["hf"] = str(hf)
    out["shards"] = str(work / "valid-shards")
    tok = load_tokenizer(tok_path)
    meta = prepare(DocStream(Corpus([out["jsonl"]]), tok, shuffle_window=0), out["shards"], progress=False)
    return out, meta


def _serve(sources: dict[str, str], port: int) -> subprocess.Popen:
    """moto's S3 server in its own process, holding copies of the REMOTE sources in bucket `bench`."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    import s3fs

    fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while True:
        try:
            fs.mkdir("bench")
            break
        except Exception:
            if time.monotonic() > deadline or server.poll() is not None:
                raise
            time.sleep(0.2)
    for name in REMOTE:
        path = Path(sources[name])
        if path.is_dir():  # no trailing slash: the folder becomes bench/NAME rather than going inside it
            fs.put(str(path), f"bench/{name}", recursive=True)
        else:
            fs.put(str(path), f"bench/{name}/{path.name}")
    return server


def _remote_url(name: str, path: str) -> str:
    p = Path(path)
    return f"s3://bench/{name}" if p.is_dir() else f"s3://bench/{name}/{p.name}"


def _measure(
    data: str, tok, seconds: float, seq_len: int, batch_size: int, merge: bool = True
) -> tuple[int, float, int]:
    from lmpipe.producer.batching import BatchSpec, batches
    from lmpipe.producer.sources import Corpus
    from lmpipe.producer.stream import DocStream

    # merge=False: remote shards fetch every document with its own request, as on a corpus too large for
    # the documents of one chunk to lie within MERGE_GAP of each other
    _RemoteShards.MERGE_GAP = MERGE_GAP if merge else -1

    tokens = passes = 0
    t0 = time.perf_counter()
    corpus = Corpus([data])  # once, as a producer does; every pass reads the files again
    while time.perf_counter() - t0 < seconds:
        stream = DocStream(corpus, tok, seed=passes, shuffle_window=1000)
        spec = BatchSpec(strategy="pack", seq_len=seq_len, batch_size=batch_size)
        tokens += sum(b.real_tokens for b in batches(stream, spec, epochs=1))
        passes += 1
    return tokens, time.perf_counter() - t0, passes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="minimum time per source per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--work", default="/tmp/lmpipe-bench", help="where the WikiText-2 tokenizer is kept")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from bench.trainbench import bench_data
    from lmpipe.producer import remote
    from lmpipe.shared.tokenizer import load_tokenizer

    tok_path, _ = bench_data(Path(args.work))
    load = [os.getloadavg()[0]]
    tok = load_tokenizer(tok_path)
    with tempfile.TemporaryDirectory(prefix="lmpipe-sources-") as tmp:
        local, meta = _build(Path(tmp), tok_path)
        port = free_port_pair()
        server = _serve(local, port)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
        remote.filesystem.cache_clear()
        try:
            sources = {name: path for name, path in local.items()}
            sources |= {f"s3 {name}": _remote_url(name, local[name]) for name in REMOTE}
            sources[PER_DOC] = sources["s3 shards"]
            rates: dict[str, list[float]] = {s: [] for s in sources}
            ratios: dict[str, list[float]] = {s: [] for s in sources}
            passes = dict.fromkeys(sources, 0)
            for r in range(args.rounds):
                for name, data in sources.items():
                    tokens, dt, n = _measure(
                        data, tok, args.seconds, args.seq_len, args.batch_size, name != PER_DOC
                    )
                    rates[name].append(tokens / dt)
                    passes[name] += n
                    print(f"round {r + 1}: {name}: {tokens / dt:,.0f} tokens/s", flush=True)
                for name in sources:
                    ratios[name].append(rates[name][-1] / rates["text"][-1])
            load.append(os.getloadavg()[0])
        finally:
            server.terminate()
            server.wait()
        sizes = {name: sum(f.stat().st_size for f in Path(path).rglob("*")) if Path(path).is_dir()
                 else Path(path).stat().st_size for name, path in local.items()}  # fmt: skip
    rows = [
        [name, statistics.median(rates[name]), statistics.median(ratios[name]), passes[name],
         f"{sizes[name.removeprefix('s3 ').split(',')[0]] / 2**20:.2f}"]
        for name in sources
    ]  # fmt: skip
    body = (
        f"WikiText-2 valid.txt ({meta['documents']:,} blank-line documents, {meta['tokens']:,} tokens; the same "
        f"documents in every source), a 32k BPE trained on WikiText-2, pack, T={args.seq_len}, "
        f"{args.batch_size} rows, one worker, {os.cpu_count()} cores visible (encode_batch uses all of "
        f"them). {args.rounds} rounds of at least {args.seconds:.0f} s per source, sources taking turns; "
        "tokens/s is the median over rounds, `vs text` the median of the per-round ratios. `s3 X` is X on an "
        "S3 server (moto) on loopback; `s3 shards, a request per document` turns off the merging of nearby "
        "documents into one read, as a corpus far larger than this one gets. Load average "
        f"{load[0]:.1f} at the start, {load[-1]:.1f} at the end (other jobs share the cores: absolute "
        "tokens/s move between rounds, ratios much less).\n\n"
        + table(["source", "tokens/s", "vs text", "passes", "MiB on disk"], rows)
    )
    print(body)
    write_result("sources", "Producer throughput by corpus source", body, args.out)


if __name__ == "__main__":
    main()
