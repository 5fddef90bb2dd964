"""Several hosts, simulated for real: producers and the trainer each in a network namespace of their own.

Each "host" (tests/netbed.py) has its own address on a private switch, its own hostname, and reaches the
others only over its link; keys are made with `lmpipe keys` and copied the way a user copies them, and
every process is the `lmpipe train` / `lmpipe produce` a user starts on real hosts. Links are cut
(`ip link set ... down` on the switch port) and slowed (`tc ... tbf`) under a running job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lmpipe.shared.messages import STOP_GRACE
from tests.helpers import (
    assert_exactly_once,
    builtin_lengths,
    doc_log_entries,
    lmpipe_env,
    read_doc_log,
    steps_logged,
    wait_until,
)
from tests.netbed import PREFIX, NetBed, NetBedUnavailable, check_available, remove_leftovers

pytestmark = pytest.mark.slow

PORT = 5555  # every host has its own port space: fixed ports cannot collide
METRICS = 9400
PRODUCERS = ["p0", "p1", "p2"]
HOSTS = ["trainer", *PRODUCERS, "spare"]  # the spare host stands in for a replacement machine


@pytest.fixture
def bed(tmp_path):
    b = NetBed(HOSTS, tmp_path)
    try:
        b.__enter__()
    except NetBedUnavailable as exc:
        pytest.skip(f"no simulated hosts on this machine: {exc}")
    try:
        yield b
    finally:
        b.close()


def job(docs: int, seq_len: int = 64, batch: int = 4, epochs: int = 1) -> list[str]:
    return ["--producers", "3", "--builtin-docs", str(docs), "--seq-len", str(seq_len),
            "--batch-size", str(batch), "--epochs", str(epochs), "--port", str(PORT)]  # fmt: skip


def make_keys(bed: NetBed, tmp: Path) -> tuple[Path, dict[str, Path]]:
    """`lmpipe keys` on the trainer host; each producer host gets a copy of the two files it needs."""
    keys = tmp / "keys"
    p = bed.start("trainer", "keys", "--out", str(keys), name="keys", env=lmpipe_env())
    assert p.wait(timeout=60) == 0, bed.log(p)
    copies = {}
    for host in HOSTS[1:]:
        d = tmp / f"{host}-keys"
        d.mkdir()
        for f in ("client.key_secret", "server.key"):
            shutil.copy(keys / f, d / f)
        copies[host] = d
    return keys, copies


def start_job(bed: NetBed, tmp: Path, common: list[str], trainer_extra: list[str] = ()):
    keys, copies = make_keys(bed, tmp)
    trainer = bed.start(
        "trainer", "train", *common, "--host", "0.0.0.0", "--curve-dir", str(keys), "--metrics-port", str(METRICS),
        "--metrics-host", "0.0.0.0", "--threads", "1", "--log-every", "5", *trainer_extra, name="trainer",
        env=lmpipe_env(),
    )  # fmt: skip
    producers = {host: start_producer(bed, host, common, copies[host]) for host in PRODUCERS}
    return trainer, producers


def start_producer(bed: NetBed, host: str, common: list[str], keys: Path):
    return bed.start(
        host, "produce", *common, "--host", bed["trainer"].addr, "--curve-dir", str(keys), "--worker", "-1",
        "--metrics-port", str(METRICS), "--metrics-host", "0.0.0.0", name=host, env=lmpipe_env(),
    )  # fmt: skip


def shards_of(bed: NetBed, p) -> set[int]:
    """The shards a producer holds now, by its log (its last assignment; empty while it stands by)."""
    bed.wait_for(p, "the trainer assigned shards")
    last = re.findall(r"assigned shards ([\d,]+|none)", bed.log(p))[-1]
    return set() if last == "none" else {int(x) for x in last.split(",")}


def data_peers(bed: NetBed) -> set[str]:
    """Addresses with a TCP connection to the trainer's data port, as the trainer host sees them."""
    out = bed.run("trainer", "ss", "-tn", "state", "established", f"( sport = :{PORT} )")
    return {m.group(1) for line in out.splitlines() if (m := re.search(r"([\d.]+):\d+\s*$", line))}


def exit_code(p: subprocess.Popen, timeout: float) -> int | None:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def sample(metrics: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s series that carry `labels` (a producer's series also carry its worker id)."""
    rows = [v for (n, lb), v in metrics.items() if n == name and set(labels.items()) <= set(lb)]
    assert rows, f"{name}{labels or ''} is not served"
    return sum(rows)


# -- the bed itself ---------------------------------------------------------------------------------------


def test_bed_is_removed_even_when_the_test_fails(tmp_path):
    try:
        check_available()
    except NetBedUnavailable as exc:
        pytest.skip(str(exc))
    with pytest.raises(RuntimeError, match="the test failed"), NetBed(["a", "b"], tmp_path) as b:
        made = b.namespaces()
        p = b.start("a", "train", "--steps", "0", "--metrics-port", "-1", name="t", env=lmpipe_env())
        raise RuntimeError("the test failed")
    assert len(made) == 3 and b.namespaces() == []
    assert p.poll() is not None, "processes on the bed's hosts are killed with it"


def test_leftovers_of_a_crashed_run_are_removed(tmp_path):
    try:
        check_available()
    except NetBedUnavailable as exc:
        pytest.skip(str(exc))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the "crashed" test process
    stale = f"{PREFIX}{gone.pid}-dead00-sw"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_leftovers()
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


# -- lmpipe on several hosts ------------------------------------------------------------------------------


def test_three_producer_hosts_feed_one_trainer(bed, tmp_path, tok):
    docs = 300
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    trainer, producers = start_job(
        bed, tmp_path, job(docs), ["--steps", "0", "--doc-log", str(log), "--summary-json", str(summary)]
    )
    t0 = time.monotonic()
    shards = {host: shards_of(bed, p) for host, p in producers.items()}
    assert sorted(s for v in shards.values() for s in v) == list(range(16))
    assert all(len(v) in (5, 6) for v in shards.values()), shards
    # each producer came from its own host, over the switch, to the trainer's address
    wait_until(lambda: data_peers(bed) == {bed[h].addr for h in producers}, 10, "a connection from each host")
    assert trainer.wait(timeout=120) == 0, bed.log(trainer)
    print(f"3 hosts: {time.monotonic() - t0:.1f} s, {steps_logged(log)} steps")
    text = bed.log(trainer)
    for host in producers:
        assert re.search(rf"producer #\d joined from {host}:\d+: holds shards ", text), text
        assert producers[host].wait(timeout=15) == 0, bed.log(producers[host])
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0 and out["stale"] == 0
    assert {b["shard"] for e in doc_log_entries(log) for b in e["batches"]} == set(range(16))
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, docs))


def test_a_partitioned_host_rejoins_and_every_document_is_trained_once(bed, tmp_path, tok):
    # Each host's share (~160k tokens in batches of 4 KiB+) must outlast what its link buffers while cut: the
    # kernel's socket buffers at both ends (128 KiB each, ~30 batches) plus ZeroMQ's queues. With 1200 docs
    # (48k tokens a host) the cut host could hand its whole share to its buffers and finish while cut.
    docs, cut_seconds = 4000, 20
    log, summary = tmp_path / "docs.jsonl", tmp_path / "summary.json"
    trainer_args = ["--steps", "0", "--doc-log", str(log), "--summary-json", str(summary)]
    trainer, producers = start_job(bed, tmp_path, job(docs, seq_len=128, batch=8), trainer_args)
    shards = {host: shards_of(bed, p) for host, p in producers.items()}
    cut_host, w = "p2", shards["p2"]
    others = [h for h in shards if h != cut_host]
    wait_until(lambda: steps_logged(log) >= 10, 60, "step 10")
    assert "finished" not in bed.log(producers[cut_host]), "the cut host still has data to send"
    sent = "lmpipe_producer_batches_sent_total"

    def received(m: dict, host: str) -> float:
        return sum(sample(m, "lmpipe_trainer_batches_received_total", shard=str(s)) for s in shards[host])

    bed.cut(cut_host)
    t_cut, steps_at_cut = time.monotonic(), steps_logged(log)
    connected, mid = [], None
    while (now := time.monotonic()) < t_cut + cut_seconds:
        tm, pm = bed.scrape("trainer", METRICS), bed.scrape(cut_host, METRICS)
        connected.append(sample(tm, "lmpipe_trainer_producers_connected"))
        if mid is None and now >= t_cut + 3:  # what the cut host's own buffers take, they have taken
            mid = (tm, pm)
        time.sleep(0.5)
    end = (bed.scrape("trainer", METRICS), bed.scrape(cut_host, METRICS))
    bed.restore(cut_host)
    t_restore, steps_at_restore = time.monotonic(), steps_logged(log)
    assert sample(end[1], sent) == sample(mid[1], sent), "no batch left the cut host"
    assert min(connected) == 2, "the trainer saw the cut host's heartbeats stop"
    during = doc_log_entries(log)[steps_at_cut:steps_at_restore]
    fed = sum(1 for e in during if any(b["shard"] not in w for b in e["batches"]))
    assert fed >= 20, f"the trainer kept stepping on the other hosts ({fed} steps in {cut_seconds} s)"
    assert all(received(end[0], o) > received(mid[0], o) for o in others), "both other hosts fed it"
    assert "finished" not in bed.log(producers[cut_host])

    # the link is back: the cut host's sends resume on the same connections (TCP retransmits)
    wait_until(
        lambda: sample(bed.scrape(cut_host, METRICS), sent) > sample(end[1], sent), 60, "resumed sends"
    )
    print(f"partition: {len(during)} steps ({fed} fed by the other hosts) in {cut_seconds} s, "
          f"producers connected {min(connected):.0f}; sends resumed {time.monotonic() - t_restore:.1f} s "
          f"after the link came back; the cut host had sent {sample(mid[1], sent):.0f} batches when cut")  # fmt: skip
    assert trainer.wait(timeout=120) == 0, bed.log(trainer)
    for p in producers.values():
        assert exit_code(p, 15) == 0, bed.log(p)[-3000:]
    out = json.loads(summary.read_text())
    assert out["stopped_by"] == "end of data" and out["rejected"] == 0
    entries = doc_log_entries(log)
    assert any(b["shard"] in w for e in entries[steps_at_restore:] for b in e["batches"]), "the host rejoined"
    assert "left" not in bed.log(trainer), "a cut shorter than 30 s keeps the host's shards where they were"
    assert len({b["session"] for e in entries for b in e["batches"]}) == 1
    assert_exactly_once(read_doc_log(log), builtin_lengths(tok, docs))


def test_a_slow_link_shows_in_its_producers_metrics(bed, tmp_path):
    # p2's link carries 1 KB/s each way; a batch is 8 x 128 uint16 tokens and as many segment ids (4 KiB+)
    kbit, burst, min_batch_bytes = 8, 4096, 8 * 128 * 2 * 2
    try:
        bed.limit("p2", kbit)
    except NetBedUnavailable as exc:
        pytest.skip(str(exc))
    # 6000 documents, about 230 batches a host: the slow host's socket buffers and high-water marks hold
    # some 40 batches whatever its link, which 2100 documents (82 a host) made close to the 0.6 below: a race
    trainer, producers = start_job(bed, tmp_path, job(6000, seq_len=128, batch=8), ["--steps", "0"])
    t0 = time.monotonic()
    shards = {host: shards_of(bed, p) for host, p in producers.items()}

    def received(m: dict, host: str) -> float:
        return sum(sample(m, "lmpipe_trainer_batches_received_total", shard=str(s)) for s in shards[host])

    # the fast hosts have handed their whole epoch to their sockets and the trainer has taken a dozen
    # batches from each: how far has the slow host come meanwhile?
    for host in ("p0", "p1"):
        bed.wait_for(producers[host], "finished its 1 epoch", timeout=120)
    wait_until(lambda: min(received(bed.scrape("trainer", METRICS), h) for h in ("p0", "p1")) >= 12, 120,
               "12 batches from each fast host")  # fmt: skip
    t1 = time.monotonic()
    m = {h: bed.scrape(h, METRICS) for h in ["trainer", *PRODUCERS]}
    sent = {h: sample(m[h], "lmpipe_producer_batches_sent_total") for h in producers}
    blocked = {h: sample(m[h], "lmpipe_producer_send_blocked_seconds_total") for h in producers}
    got = {h: received(m["trainer"], h) for h in producers}
    print(f"after {t1 - t0:.1f} s: sent {sent}, blocked {blocked}, received {got}")
    assert "finished" not in bed.log(producers["p2"])
    assert sent["p2"] <= 0.6 * min(sent["p0"], sent["p1"]), "the slow host's producer sent the fewest batches"
    # what reached the trainer from p2 fits through its link, and is a fraction of the others' share
    assert got["p2"] * min_batch_bytes <= kbit * 125 * (t1 - t0) + burst + min_batch_bytes
    assert 3 * got["p2"] <= min(got["p0"], got["p1"])
    trainer.terminate()
    assert trainer.wait(timeout=STOP_GRACE + 10) == 0, bed.log(trainer)
    for host in PRODUCERS:  # p2 too: the trainer waits for its `bye` (see the test below)
        assert producers[host].wait(timeout=30) == 0, bed.log(producers[host])


def test_the_end_of_the_run_reaches_a_host_on_a_congested_link(bed, tmp_path):
    try:
        bed.limit("p2", 8)
    except NetBedUnavailable as exc:
        pytest.skip(str(exc))
    trainer, producers = start_job(bed, tmp_path, job(1800, seq_len=128, batch=8, epochs=0), ["--steps", "0"])
    shards_of(bed, producers["p2"])

    def control_backing_off() -> bool:
        """The trainer's control connection to p2 waits on acknowledgements queued behind p2's data."""
        out = bed.run("trainer", "ss", "-tni", "dst", bed["p2"].addr, f"( sport = :{PORT + 1} )")
        return "backoff:" in out

    wait_until(control_backing_off, 60, "the control connection to back off")
    trainer.terminate()  # the end of the run, as a step limit or a Ctrl-C ends it
    assert trainer.wait(timeout=STOP_GRACE + 10) == 0, bed.log(trainer)  # it waits for p2's bye
    for host in PRODUCERS:
        assert exit_code(producers[host], 10) == 0, f"{host} is still up: {bed.log(producers[host])[-2000:]}"


def test_a_host_replaced_while_cut_off_rejoins_when_it_returns_and_nothing_is_trained_twice(
    bed, tmp_path, tok
):
    """p2 is cut off; the operator starts a spare host, which joins at once and takes its share of the
    shards; after 30 s without heartbeats the trainer drops p2 and spreads its shards; when p2's link comes
    back it joins again as a new producer (no retry loop) and gets shards; nothing is trained twice."""
    docs = 20_000  # the epoch outlasts the test: the trainer is still there when p2 comes back
    log = tmp_path / "docs.jsonl"
    trainer, producers = start_job(bed, tmp_path, job(docs), ["--steps", "0", "--doc-log", str(log)])
    shards_of(bed, producers["p2"])
    wait_until(lambda: steps_logged(log) >= 10, 60, "step 10")
    bed.cut("p2")
    time.sleep(6)
    spare = start_producer(bed, "spare", job(docs), tmp_path / "p2-keys")
    assert shards_of(bed, spare), "the spare took shards at once, from the busiest producers"
    wait_until(lambda: "left (connection closed)" in bed.log(trainer), 60, "the trainer to drop the cut host")
    assert re.search(
        r"producer #\d \(p2:\d+\) left \(connection closed\): shards [\d,]+ moved", bed.log(trainer)
    )
    steps_before = steps_logged(log)
    bed.restore("p2")
    old = producers["p2"]
    wait_until(lambda: len(re.findall(r"joined from p2:", bed.log(trainer))) == 2, 90, "p2 to join again")
    sent = "lmpipe_producer_batches_sent_total"
    before = sample(bed.scrape("p2", METRICS), sent)
    wait_until(lambda: sample(bed.scrape("p2", METRICS), sent) > before + 3, 60, "p2 to send again")
    assert "refused" not in bed.log(old) and old.poll() is None, bed.log(old)[-2000:]
    wait_until(lambda: steps_logged(log) >= steps_before + 20, 60, "20 more steps")
    trainer.terminate()
    assert trainer.wait(timeout=30) == 0, bed.log(trainer)
    for p in (*producers.values(), spare):
        assert p.wait(timeout=15) == 0, bed.log(p)
    # each shard's batches in order with no gap and no repeat; each document's tokens at most once
    per_shard: dict[int, list[int]] = {}
    for e in doc_log_entries(log):
        for b in e["batches"]:
            per_shard.setdefault(b["shard"], []).append(b["seq"])
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in per_shard.values()), per_shard
    lengths = builtin_lengths(tok, docs)
    for did, parts in read_doc_log(log).items():
        covered = [0] * lengths[did]
        for start, n in parts:
            for i in range(start, start + n):
                covered[i] += 1
        assert max(covered) == 1, f"document {did} trained twice"
