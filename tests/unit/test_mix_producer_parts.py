"""The producer's mixture parts in-process: credits decide which shard's batch is built next, a welcome sets
a shard's credit and a credit only raises it; each source's corpus facts reach the hello, so that a change in
any one source is seen; without a mixture the facts are the one corpus's, exactly as before."""

from __future__ import annotations

import json

import numpy as np

from lmpipe.producer.batching import BatchSpec
from lmpipe.producer.corpora import Corpora
from lmpipe.producer.held import Holdings
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared.batch import Cursor
from lmpipe.shared.config import PipelineConfig
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
    assert h.waiting_for_credit()
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
    assert not h.waiting_for_credit()


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
