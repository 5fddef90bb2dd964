"""The per-object versions a checkpoint keeps (header `data_objects`, Corpus.object_versions) and what a
resume names from them (Corpus.rewritten): only the objects whose version changed; nothing from a value
that is not one for these objects; and no entry past MAX_NAMED_OBJECTS objects, so that a header stays small.
In-process, on a corpus of stand-in objects (the real store's: tests/e2e/test_storage_runs.py)."""

from __future__ import annotations

import json

from lmpipe.producer import sources
from lmpipe.producer.formats.kinds import DataFile
from lmpipe.producer.sources import Corpus


class _Store:
    """What a corpus asks of a remote object's store here: its URL."""

    def key(self, path: str) -> str:
        return path.removeprefix("s3://")

    def url(self, key: str) -> str:
        return f"s3://{key}"


def _corpus(versions: list[str]) -> Corpus:
    c = Corpus()
    store = _Store()
    c.paths = [
        DataFile(f"s3://b/p{i}.txt", "text", size=100, remote=store, version=v)
        for i, v in enumerate(versions)
    ]  # type: ignore[arg-type]
    return c


def test_only_the_rewritten_objects_are_named():
    before = _corpus(["e0", "e1", "e2", "e3"])
    kept = before.object_versions()
    ((where, digests),) = kept.items()
    assert where == before.version_digest().partition(":")[0] and len(digests) == 4 * sources.OBJECT_DIGEST
    assert before.rewritten(digests) == []
    after = _corpus(["e0", "x1", "e2", "x3"])
    assert after.object_versions().keys() == kept.keys(), "the same objects: the same location"
    assert after.rewritten(digests) == ["s3://b/p1.txt", "s3://b/p3.txt"]
    for wrong in (None, 7, digests[:-1], digests + "0" * sources.OBJECT_DIGEST):  # not these objects' value
        assert after.rewritten(wrong) == []


def test_a_corpus_of_many_objects_keeps_no_entry_per_object():
    n = sources.MAX_NAMED_OBJECTS
    at_most = _corpus([f"etag{i}" for i in range(n)])
    assert len(json.dumps(at_most.object_versions())) < 33 * 1024, "a header stays small"
    more = _corpus([f"etag{i}" for i in range(n + 1)])
    assert more.object_versions() == {} and more.version_digest(), "the location's digest only"
    assert Corpus().object_versions() == {}, "the built-in corpus has no objects"
