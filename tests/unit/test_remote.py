"""Corpora and shards on object storage, against a real S3-compatible server on loopback (moto's, in its
own process): the same records as local files, bounded memory, a permanent error stopped at once with one
line, and a server killed and restarted mid-epoch retried with every document still trained exactly once."""

from __future__ import annotations

import logging

import pytest

from lmpipe.producer import remote
from lmpipe.producer.formats import CorpusChanged
from lmpipe.producer.sources import Corpus


def test_a_version_is_what_the_store_says_of_the_content_not_its_metadata():
    """GCS's etag moves with a metadata-only update; a composite object has no MD5, only a CRC32C and its
    generation, which move with the content alone. S3's ETag is what S3 has."""
    composite = {"etag": "CJCm2Jf7hPkCEAE=", "generation": "1700000000000000", "crc32c": "yZRlqg=="}
    after_setmeta = {**composite, "etag": "CJCm2Jf7hPkCEAI="}
    assert remote.version(composite) == remote.version(after_setmeta) == "crc32c=yZRlqg=="
    assert remote.version({"md5Hash": "abc", **composite}) == "md5Hash=abc"
    assert (
        remote.version({"ETag": '"9b2cf535f27731c974343645a3985328"'})
        == "ETag=9b2cf535f27731c974343645a3985328"
    )
    assert remote.version({"size": 3}) is None
    # an HTTP server's ETag may differ from node to node behind a balancer: only a content digest counts there
    etag = {"ETag": '"5f1c-61a2b3c4"', "size": 3}
    assert remote.version(etag, "https") is None and remote.version(etag, "s3") == "ETag=5f1c-61a2b3c4"
    assert remote.version({**etag, "Content-MD5": "rL0Y20zC+Fzt72VPzMSk2A=="}, "HTTP") == (
        "Content-MD5=rL0Y20zC+Fzt72VPzMSk2A=="
    )


def test_a_server_busy_at_a_pass_boundary_is_retried_not_taken_for_a_deleted_object(monkeypatch, caplog):
    """fsspec's HTTP info() turns a failed GET into FileNotFoundError: two 503s where a pass asks the server
    for the object's version read as "deleted" and stopped the producer. They are retried, and the pass
    reads on; a real 404 is still "deleted"."""
    import base64
    import hashlib
    import http.server
    import threading

    monkeypatch.setattr(remote, "BACKOFF", 0.05)
    monkeypatch.setattr(remote, "WAITS", remote.StorageWaits())  # no producer of an earlier test hears it
    body = b"".join(b"document %d of the corpus\n\n" % i for i in range(400))
    state = {"busy": 0, "gone": False}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, head: bool) -> None:
            if state["busy"] or state["gone"]:
                state["busy"] = max(0, state["busy"] - 1)
                self.send_response(503 if not state["gone"] else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data, headers = body, {}
            if rng := self.headers.get("Range"):
                a, _, b = rng.split("=")[1].partition("-")
                data = body[int(a) : (int(b) + 1 if b else len(body))]
                headers["Content-Range"] = f"bytes {a}-{int(a) + len(data) - 1}/{len(body)}"
            self.send_response(206 if headers else 200)
            headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
            headers |= {"Content-Length": str(len(data)), "Accept-Ranges": "bytes"}
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def do_HEAD(self):
            self._send(True)

        def do_GET(self):
            self._send(False)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        c = Corpus([f"http://127.0.0.1:{server.server_address[1]}/corpus.txt"])
        assert c.paths[0].version and c.paths[0].version.startswith("Content-MD5=")
        first = [r.text for r in c.records()]
        state["busy"] = 2  # the HEAD and info()'s GET after it
        with caplog.at_level(logging.WARNING, logger="lmpipe"):
            assert [r.text for r in c.records()] == first
        assert any("; retry 1/" in r.getMessage() for r in caplog.records)
        state["gone"] = True
        with pytest.raises(CorpusChanged, match=r"changed during the run \(deleted\)"):
            list(c.records())
    finally:
        server.shutdown()
