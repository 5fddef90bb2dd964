"""The producer's mixture parts in-process: credits decide which shard's batch is built next, a welcome sets
a shard's credit and a credit only raises it; each source's corpus facts reach the hello, so that a change in
any one source is seen; without a mixture the facts are the one corpus's, exactly as before."""

from __future__ import annotations

import json

import numpy as np

from lmpipe.producer import manager
from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.corpora import Corpora
from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.held import Holdings
from lmpipe.producer.sources import OBJECT_DIGEST, Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages
from lmpipe.shared.batch import Cursor
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.messages import Assign, Welcome
from lmpipe.shared.mix import source_seed
from lmpipe.shared.tokenizer import load_tokenizer


def _holdings(n: int) -> Holdings:
    spec = BatchSpec(strategy="pad", seq_len=8, batch_size=1)
    corpus, tok = Corpus(builtin_docs=40), load_tokenizer()
    h = Holdings(lambda s, total: DocStream(corpus, tok, s, total), spec, 0, np.int32)
    for s in range(n):
        h.start(s, n, "L", Cursor(), 1, credit=1)
    return h


def _next_shards(h: Holdings, k: int) -> list[int | None]:
    out: list[int | None] = []
    for _ in range(k):
        nxt = h.next_message("s")
        out.append(None if nxt is None else nxt[0].shard)
    return out


def test_the_least_advanced_shard_with_credit_goes_next():
    h = _holdings(3)
    assert _next_shards(h, 4) == [0, 1, 2, None]  # one each, then none has credit
    assert not any(x.can_send() for x in h.shards.values())
    h.grant({2: 3, 7: 9})  # a shard not held is left alone
    assert _next_shards(h, 3) == [2, 2, None]
    h.grant({0: 2, 2: 1})  # a credit only raises
    assert _next_shards(h, 2) == [0, None] and h.shards[2].credit == 3
    h.start(2, 3, "L", Cursor(), 1, credit=1)  # a resend: the welcome's credit again
    assert h.shards[2].credit == 1 and _next_shards(h, 2) == [2, None]


def test_without_credit_nothing_limits_a_shard():
    spec = BatchSpec(strategy="pad", seq_len=4096, batch_size=1)
    corpus, tok = Corpus(builtin_docs=3), load_tokenizer()
    h = Holdings(lambda s, total: DocStream(corpus, tok, s, total), spec, 1, np.int32)
    h.start(0, 1, "L", Cursor(), 1)
    h.grant({0: 1})  # unlimited stays unlimited
    assert _next_shards(h, 5) == [0, 0, 0, 0, None]  # three batches and the end


def _files(tmp_path, **texts: str) -> dict[str, str]:
    out = {}
    for name, text in texts.items():
        p = tmp_path / f"{name}.txt"
        p.write_text(text)
        out[name] = str(p)
    return out


def test_each_source_is_read_with_its_own_seed_epochs_and_shards(tmp_path):
    f = _files(tmp_path, web="a\n\nb\n", math="c\n\nd\n")
    mix = tmp_path / "m.toml"
    mix.write_text(
        f"[sources.web]\ndata='{f['web']}'\nweight=1\n[sources.math]\ndata='{f['math']}'\nweight=1\nepochs=2\n"
    )
    c = Corpora(PipelineConfig(mix_file=str(mix), seed=7, epochs=5))
    assert [c.locate(s, 8) for s in (0, 3, 4, 7)] == [(0, 0, 4), (0, 3, 4), (1, 0, 4), (1, 3, 4)]
    assert (c.epochs(0), c.epochs(1)) == (5, 2)
    assert c.plan(5, 8) == (c.batch_spec(1), 2) and c.batch_spec(1).seed == source_seed(7, "math")
    assert c.seed(0) == source_seed(7, "web") != c.seed(1)
    assert (
        c.split_problem(Assign("s", [], 7)) is not None and c.split_problem(Welcome("s", 0, shards=8)) is None
    )


def test_the_hello_facts_cover_every_source(tmp_path):
    f = _files(tmp_path, web="one\n\ntwo\n", math="three\n")
    cfg = PipelineConfig(mix=[f"web={f['web']}:0.5", f"math={f['math']}:0.5"])
    c = Corpora(cfg)
    data = json.loads(c.fingerprint())
    assert list(data) == ["web", "math"]
    assert (
        data["web"] == Corpus([f["web"]]).fingerprint() and data["math"] == Corpus([f["math"]]).fingerprint()
    )
    before = c.content_digest()
    assert before
    (tmp_path / "math.txt").write_text("THREE\n")  # same name and size, other content, in one source
    assert Corpora(cfg).content_digest() != before
    assert Corpora(cfg).fingerprint() == c.fingerprint()
    assert c.version_digest() == "" and c.object_versions() == {}  # local files report no versions


def test_without_a_mixture_the_facts_are_the_corpus_s(tmp_path):
    f = _files(tmp_path, web="one\n\ntwo\n")
    cfg = PipelineConfig(data=[f["web"]], epochs=3, seed=4)
    c, corpus = Corpora(cfg), Corpus.of(cfg)
    assert (c.fingerprint(), c.content_digest(), c.version_digest()) == (
        corpus.fingerprint(),
        corpus.content_digest(),
        corpus.version_digest(),
    )
    assert c.locate(3, 5) == (0, 3, 5) and c.plan(3, 5) == (BatchSpec.of(cfg), 3)
    assert c.seed(0) == 4 and c.split_problem(Welcome("s", 0, shards=7)) is None


class _Store:
    """What a corpus asks of a remote object's store here: its URL."""

    def key(self, path: str) -> str:
        return path.removeprefix("s3://")

    def url(self, key: str) -> str:
        return f"s3://{key}"


def _objects(bucket: str, versions: list[str]) -> Corpus:
    c = Corpus()
    c.paths = [
        DataFile(f"s3://{bucket}/p{i}.txt", "text", size=100, remote=_Store(), version=v)  # type: ignore[arg-type]
        for i, v in enumerate(versions)
    ]
    return c


def test_the_remote_versions_of_every_source_are_pinned_and_a_rewrite_named(tmp_path):
    f = _files(tmp_path, web="one\n")
    cfg = PipelineConfig(mix=[f"web={f['web']}:1", "code=s3://code/:1", "math=s3://math/:1"])
    mix = cfg.mixture()

    def corpora(code: list[str], math: list[str]) -> Corpora:
        return Corpora(
            cfg, mix=mix, corpora=[Corpus([f["web"]]), _objects("code", code), _objects("math", math)]
        )

    before = corpora(["c0", "c1"], ["m0", "m1", "m2"])
    versions, kept = before.version_digest(), before.object_versions()
    assert messages.VERSIONS_SHAPE.fullmatch(versions), "a hello may carry it"
    ((where, digests),) = kept.items()
    assert where == messages.version_location(versions) and len(digests) == 5 * OBJECT_DIGEST
    assert before.rewritten(digests) == []
    after = corpora(["c0", "c1"], ["m0", "x1", "m2"])  # one object of one source rewritten
    assert after.version_digest() != versions and messages.version_location(after.version_digest()) == where
    assert after.rewritten(digests) == ["s3://math/p1.txt"]
    assert after.rewritten(digests[:-1]) == [] and after.rewritten(None) == []


def test_a_ranks_source_shard_is_read_as_that_sources_global_shard(tmp_path):
    """Under torchrun, rank 1 of 2 with 2 shards a source: its shard 3 is source 1's shard 1, global shard
    1*2+1 of 4 of that source's records, with that source's seed (the stream a --data run of it would read)."""
    f = _files(tmp_path, web="a\n\nb\n", math="c\n\nd\n")
    cfg = PipelineConfig(
        mix=[f"web={f['web']}:1", f"math={f['math']}:1"],
        rank=1,
        world_size=2,
        runtime_dir=str(tmp_path / "r"),
    )
    p = manager.Producer(cfg, manager.ProducerOptions())
    stream = p._stream(3, 4)
    assert (stream.worker_global, stream.total_workers, stream.seed) == (3, 4, source_seed(0, "math"))
    assert stream.corpus is p.corpora.corpora[1] and stream.scan is not None and stream.scan.total == 4
    assert p.holdings._plan(3, 4) == (p.corpora.batch_spec(1), 0)


def test_a_hello_of_the_largest_mixture_stays_small(tmp_path):
    """64 sources (the most), with long names and files: the fingerprint's `data` keeps each source within
    its share, so the hello (with a full list of skipped counts) decodes within the control limit."""
    names = [f"source-with-a-long-name-{i:08d}" for i in range(64)]
    for i in range(64):
        (tmp_path / f"s{i}").mkdir()
        for k in range(5):
            (tmp_path / f"s{i}" / f"a-corpus-file-with-a-long-name-{k:04d}.txt").write_text(f"doc {k}\n")
    cfg = PipelineConfig(mix=[f"{n}={tmp_path / f's{i}'}/:1" for i, n in enumerate(names)])
    c = Corpora(cfg)
    assert list(json.loads(c.fingerprint())) == names
    skipped = {f"{s}:a_long_reason_name_here": 10**9 for s in range(messages.SKIPPED_PER_MESSAGE)}
    hello = messages.Hello(fingerprint=fingerprint(cfg, "f" * 64, 50257, c.fingerprint()), skipped=skipped,
                           data_content=c.content_digest(), host="h" * 64)  # fmt: skip
    raw = messages.pack(hello)
    assert len(raw) < messages.MAX_CONTROL_BYTES and messages.unpack(raw).fingerprint == hello.fingerprint
