"""Object-storage faults seen for what they are: moto's S3 server (tests/s3server.py, its own process)
behind a fault-injecting proxy on loopback (tests/faultproxy.py): slow answers, 503/429 every Nth request,
a stopped server; and endpoints that can never work (TLS against a plain server, a name that does not
resolve), which must stop at once instead of being retried for half a minute."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from lmpipe.producer import manager, remote
from lmpipe.producer.sources import Corpus
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server

BUCKET = "corp"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3")
    for k in range(3):
        path = root / BUCKET / f"part{k}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(json.dumps({"text": f"document {k}.{i} of the test"}) + "\n" for i in range(20))
        )
    server = S3Server(root, tmp_path_factory.mktemp("s3log") / "server.log")
    server.start()
    yield server.port
    server.kill()


@pytest.fixture
def endpoint(monkeypatch):
    """Point S3 at a URL (a fresh filesystem, none of s3fs's cached listings); with a fast retry policy."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr(remote, "BACKOFF", 0.05)
    monkeypatch.setattr(remote, "MAX_BACKOFF", 0.2)
    monkeypatch.setattr(remote, "WAITS", remote.StorageWaits())

    def point(url: str) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        remote.filesystem.cache_clear()
        import fsspec

        fsspec.filesystem("s3").clear_instance_cache()

    yield point
    point("")  # no filesystem cached for this test's endpoint: a later test's would reach it
    remote.filesystem.cache_clear()


def read_all(url: str = f"s3://{BUCKET}/") -> int:
    return sum(1 for r in Corpus([url]).records() if r.bad is None)


def retry_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "; retry " in r.getMessage()]


@pytest.mark.parametrize("status", [503, 429])
def test_every_throttled_request_is_one_retry_of_ours_and_logged(s3, endpoint, caplog, status):
    """503 SlowDown / 429 on every 3rd request: s3fs and botocore retry nothing themselves (they did up to
    5 times, unlogged), so each injected error is exactly one logged retry, and every document is read."""
    with FaultProxy(s3) as proxy, caplog.at_level(logging.WARNING, logger="lmpipe.producer"):
        proxy.fail_every, proxy.fail_status = 3, status
        endpoint(proxy.endpoint)
        assert read_all() == 60
    assert proxy.failed >= 3
    assert len(retry_lines(caplog)) == proxy.failed, (proxy.failed, retry_lines(caplog))


def test_a_tls_endpoint_on_a_plain_server_stops_at_once_in_one_line(s3, endpoint, caplog):
    endpoint(f"https://127.0.0.1:{s3}")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"), pytest.raises(OSError) as err:
        read_all()
    assert time.monotonic() - t0 < 5
    assert "TLS failed" in str(err.value) and "\n" not in str(err.value)
    assert retry_lines(caplog) == []


def test_an_endpoint_name_that_does_not_resolve_stops_at_once(endpoint, caplog):
    endpoint("http://no-such-host.invalid:9000")
    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"), pytest.raises(OSError) as err:
        read_all()
    assert "does not resolve" in str(err.value), err.value
    assert retry_lines(caplog) == []


def test_slow_storage_moves_the_producers_storage_wait_metric(s3, endpoint, tmp_path):
    """A producer made on a slow store (0.2 s an answer): its listing and first reads show as storage wait."""
    with FaultProxy(s3) as proxy:
        proxy.delay = 0.2
        endpoint(proxy.endpoint)
        cfg = PipelineConfig(data=[f"s3://{BUCKET}/"], producers=1, runtime_dir=str(tmp_path / "run"))
        p = manager.Producer(cfg, manager.ProducerOptions())
        waited = p.metrics.storage_wait._value.get()
        assert waited >= 0.2 * proxy.requests * 0.9 and proxy.requests >= 1, (waited, proxy.requests)


def test_a_producer_in_a_retry_says_what_it_waits_for_and_a_stop_ends_the_sleep(s3, endpoint, tmp_path):
    """The store stops answering while a producer reads: its hellos (built by the control thread, which
    goes on meanwhile) name the object and the retry; a stop (here the launching process gone, as when
    the trainer is killed) ends the retry's sleep at once, not after the whole retry window."""
    with FaultProxy(s3) as proxy:
        endpoint(proxy.endpoint)
        cfg = PipelineConfig(data=[f"s3://{BUCKET}/"], producers=1, runtime_dir=str(tmp_path / "run"))
        p = manager.Producer(cfg, manager.ProducerOptions())
        proxy.down = True
        remote.MAX_BACKOFF = remote.BACKOFF = 30.0  # (restored by monkeypatch) a sleep that must not run out
        said: list[str] = []
        done = threading.Event()
        errors: list[BaseException] = []

        def read() -> None:
            try:
                for _ in p.corpus.records():
                    pass
            except BaseException as exc:  # noqa: BLE001 - the stop's exception, looked at below
                errors.append(exc)
            done.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 30
        while not p.waiting:
            assert time.monotonic() < deadline and not done.is_set(), errors
            time.sleep(0.02)
        said.append(p.waiting)
        assert messages.unpack(p._hello()).waiting == said[0], "the hellos say it"
        t0 = time.monotonic()
        p._stopping.set()  # what the control thread does once the launching process is gone
        assert done.wait(5), "the retry's sleep did not end"
        assert time.monotonic() - t0 < 2
    assert said[0].startswith(f"s3://{BUCKET}/") and said[0].endswith("(retry 1 of 7)"), said
    assert errors and type(errors[0]).__name__ == "_Stopping"
    assert json.loads(json.dumps(said))  # plain text for the wire
