"""Issue 10's attacks against a real trainer and real producers, by a real hostile pyzmq client (CPU).

Two deployments, each trained on while a hostile client (tests/hostile.py) attacks it:
- default: `lmpipe run` (Unix sockets in a private runtime directory); the client runs as another user
  (`nobody`), as any local process without special rights would;
- CURVE: `lmpipe train` + `lmpipe produce --curve-dir` on loopback TCP; the client has the trainer's public
  key and a key pair of its own, which the trainer never authorized, and tries without keys too.
The attacks: forged batches, forged `end`s against an endless run, a takeover of a stopped producer's
work (by the client, turned away; an authorized producer started meanwhile joins like any other), a flood of
800 junk connections, forged out-of-order sequence numbers. Then the run is stopped and the doc-log must
show 0 forged documents, each worker's batches in order with no gap and no repeat, and every document
trained at most once (a prefix of each worker's deterministic stream). Each attack prints its figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmpipe.producer import builtin_corpus
from lmpipe.producer.sources import Corpus
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.security import generate_keys
from lmpipe.shared.sockets import default_runtime_dir
from tests import hostile
from tests.helpers import Procs, free_ports, wait_until

pytestmark = pytest.mark.slow

PRODUCERS = 2
SHARDS = 16  # the trainer's default --shards
DOCS = 60_000  # far more than the run trains: the first epoch never ends, so no document may repeat
RUN = ["--builtin-docs", str(DOCS), "--epochs", "0", "--producers", str(PRODUCERS)]
TRAIN = ["--steps", "0", "--log-every", "10", "--threads", "1"]
RSS_BOUND = 64 * 2**20  # trainer RSS growth allowed under the flood
FLOOD_CONNS, FLOOD_SECONDS, FLOOD_FRAME = 800, 4.0, 1 << 20


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"[{v}]" for _, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def total(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Client:
    """The hostile process: one JSON command in, one JSON line of figures out.

    A fork of this process that drops to uid/gid `nobody` (for the default deployment): forked rather than
    started afresh, because the interpreter may live where `nobody` cannot read (a pyenv under /root)."""

    def __init__(self, targets: dict, as_other_user: bool):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(cmd_w)
                os.close(out_r)
                if as_other_user:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                with os.fdopen(cmd_r) as commands, os.fdopen(out_w, "w") as out:
                    hostile.serve(targets, commands, out)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(out_w)
        self.commands = os.fdopen(cmd_w, "w")
        self.out = os.fdopen(out_r)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self.result(timeout=60)
        assert hello["ready"] and (hello["uid"] == 65534) == as_other_user, hello

    def _read(self) -> None:
        for line in self.out:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, op: str, **kw) -> None:
        self.commands.write(json.dumps({"op": op, **kw}) + "\n")
        self.commands.flush()

    def result(self, timeout: float = 60) -> dict:
        line = self.lines.get(timeout=timeout)
        assert line is not None, "the hostile client died (its traceback is in the captured stderr)"
        return json.loads(line)

    def __call__(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.result()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.commands.close()


class Deployment:
    """A run under attack: the trainer, its producers, and how to read them."""

    def __init__(self, procs: Procs, tmp: Path, kind: str):
        self.procs, self.tmp, self.kind = procs, tmp, kind
        self.port = free_ports(2)
        self.mport = free_ports(1 + PRODUCERS)  # the trainer's /metrics, then each producer's
        while abs(self.mport - self.port) < 4:
            self.mport = free_ports(1 + PRODUCERS)
        self.doc_log, self.summary = tmp / "docs.jsonl", tmp / "summary.json"
        out = ["--port", str(self.port), "--doc-log", str(self.doc_log), "--summary-json", str(self.summary)]
        self.net: list[str] = []
        if kind == "curve":
            self.keys = generate_keys(tmp / "keys")
            self.net = ["--curve-dir", str(self.keys)]
            self.trainer = procs.start("train", *RUN, *TRAIN, *out, *self.net, "--metrics-port", str(self.mport),
                                       name="trainer")  # fmt: skip
            self.producers = [
                procs.start(
                    "produce",
                    *RUN,
                    *self.net,
                    "--port",
                    str(self.port),
                    "--worker",
                    str(i),
                    "--metrics-port",
                    str(self.mport + 1 + i),
                    name=f"producer{i}",
                )  # fmt: skip
                for i in range(PRODUCERS)
            ]
            self.producer_pids = [p.pid for p in self.producers]
        else:
            self.trainer = procs.start(
                "run", *RUN, *TRAIN, *out, "--metrics-port", str(self.mport), name="run"
            )
            procs.wait_for(self.trainer, "producer process(es): pids")
            line = re.search(r"pids ([\d ]+)", procs.log(self.trainer))
            self.producer_pids = [int(x) for x in line.group(1).split()]
        wait_until(lambda: self.log.count("joined from") >= PRODUCERS, 120, f"{PRODUCERS} producers joined")
        self.wait_steps(3)

    @property
    def log(self) -> str:
        return self.procs.log(self.trainer)

    def m(self) -> dict[str, float]:
        return metrics(self.mport)

    def producer_m(self, i: int) -> dict[str, float]:
        return metrics(self.mport + 1 + i)

    def steps(self) -> float:
        return self.m()["lmpipe_trainer_steps_total"]

    def wait_steps(self, n: int, timeout: float = 60) -> None:
        start, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.trainer.poll() is None, self.log[-3000:]
            try:
                s = self.steps()
            except OSError:
                s = None
            if s is not None:
                start = s if start is None else start
                if s - start >= n:
                    return
            time.sleep(0.2)
        raise AssertionError(f"the trainer did not take {n} steps in {timeout} s:\n{self.log[-3000:]}")

    def targets(self, vocab_size: int) -> dict:
        if self.kind == "curve":
            ep = [f"tcp://127.0.0.1:{self.port}"], [f"tcp://127.0.0.1:{self.port + 1}"]
            server_key = (self.keys / "server.key").read_text().split('public-key = "')[1].split('"')[0]
        else:  # where the trainer's user has its sockets, and the tcp ports of old
            d = default_runtime_dir()
            ep = (
                [f"ipc://{d}/{self.port}.data", f"tcp://127.0.0.1:{self.port}"],
                [f"ipc://{d}/{self.port}.ctl", f"tcp://127.0.0.1:{self.port + 1}"],
            )
            server_key = None
        return {"data": ep[0], "control": ep[1], "server_key": server_key, "vocab_size": vocab_size,
                "metrics": f"http://127.0.0.1:{self.mport}/metrics", "producers": PRODUCERS,
                "batch_size": 16, "seq_len": 128}  # fmt: skip

    def sample(self, seconds: float, into: list) -> None:
        """(time, steps, trainer RSS) every 0.25 s for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            into.append((time.monotonic(), self.steps(), rss(self.trainer.pid)))
            time.sleep(0.25)


def best_rate(samples: list, window: float = 2.0) -> float:
    """The highest step rate over any `window` seconds of the samples (load elsewhere on the machine
    makes single windows noisy; the question is whether the trainer is able to run at full speed)."""
    best = 0.0
    for i, (t0, s0, _) in enumerate(samples):
        for t1, s1, _ in samples[i + 1 :]:
            if t1 - t0 >= window:
                best = max(best, (s1 - s0) / (t1 - t0))
                break
    return best


def check_doc_log(path: Path, tok) -> dict:
    """0 forged documents; per shard, seqs 1..K with no gap or repeat, its own documents only; every
    document's tokens trained at most once, all but each shard's last document exactly once."""
    per_worker: dict[int, list[int]] = {}
    pieces: dict[int, list[tuple[int, int]]] = {}
    last_doc: dict[int, int] = {}
    for line in path.read_text().splitlines():
        for b in json.loads(line)["batches"]:
            per_worker.setdefault(b["shard"], []).append(b["seq"])
            for did, start, n in b["docs"]:
                assert 0 <= did < DOCS, f"document {did} is not in the corpus: a forged batch was trained"
                assert did % SHARDS == b["shard"], f"document {did} trained as shard {b['shard']}'s"
                pieces.setdefault(did, []).append((start, n))
                last_doc[b["shard"]] = did
    for w, seqs in per_worker.items():
        assert seqs == list(range(1, len(seqs) + 1)), f"shard {w}: seqs {seqs[:5]}... not 1..K in order"
    ids = sorted(pieces)
    encs = tok.tokenizer.encode_batch([builtin_corpus.document(0, i) for i in ids], add_special_tokens=False)
    partial = []
    for did, enc in zip(ids, encs):
        covered = np.zeros(len(enc.ids) + 1, np.int32)
        for start, n in pieces[did]:
            covered[start : start + n] += 1
        assert covered.max() == 1, f"document {did}: tokens trained {covered.max()} times"
        if covered.min() == 0:
            partial.append(did)
    assert set(partial) <= set(last_doc.values()), f"documents {partial} were cut short (a lost batch)"
    return {"batches": {w: len(s) for w, s in per_worker.items()}, "documents": len(ids)}


def attack(procs: Procs, tmp: Path, kind: str, tok) -> None:
    as_other_user = kind == "default"
    if as_other_user and os.geteuid() != 0:
        pytest.skip("the default deployment's attacker is another user: run as root to start it as nobody")
    dep = Deployment(procs, tmp, kind)
    hostile = Client(dep.targets(tok.vocab_size), as_other_user)
    figures: dict[str, dict] = {}
    try:
        # /metrics: reachable on loopback, but no capability in it
        figures["scrape"] = got = hostile("scrape")
        assert got["reachable"] and not got["session_found"], got

        # forged batches with valid headers and in-vocabulary ids
        before = dep.m()
        figures["forge"] = hostile("forge", n=320)
        dep.wait_steps(2)
        after = dep.m()
        for name in ("lmpipe_trainer_batches_rejected_total", "lmpipe_trainer_stale_batches_total"):
            figures["forge"][name] = total(after, name) - total(before, name)
            assert figures["forge"][name] == 0, ("the forged batches reached the trainer", figures)

        # 32 forged ends against an endless run
        figures["end"] = hostile("end", n=32)
        s0 = dep.steps()
        dep.wait_steps(5)
        figures["end"]["steps_after"] = dep.steps() - s0
        assert "finished its data" not in dep.log

        # takeover: freeze producer 0 for over 6 s (its hellos stop), and claim its work meanwhile: the client
        # (turned away at the door), and an authorized producer, which is a new producer like any other: it
        # joins and takes its share of the shards, the frozen producer keeping the rest of its own
        os.kill(dep.producer_pids[0], signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            rival = procs.start("produce", *RUN, *dep.net, "--port", str(dep.port), "--worker", "0",
                                "--metrics-port", "-1", name="rival")  # fmt: skip
            hostile.send("hello", worker=0, seconds=6.0, fingerprint=dep_fingerprint(tok))
            procs.wait_for(rival, "the trainer assigned shards", timeout=60)
            while time.monotonic() - frozen < 6.5:  # and still asking, 6.5 s into the freeze
                time.sleep(0.1)
            figures["takeover"] = got = hostile.result()
        finally:
            os.kill(dep.producer_pids[0], signal.SIGCONT)
        figures["takeover"]["frozen_s"] = round(time.monotonic() - frozen, 1)
        time.sleep(1)
        rival.kill()
        assert not got["welcomed"], got
        assert dep.log.count("joined from") == PRODUCERS + 1, dep.log
        figures["takeover"]["rival"] = "an authorized producer: joined and took its share of the shards"
        dep.wait_steps(3)

        # flood: 800 junk connections for 4 s; RSS and step rate before, during, after
        before_s: list = []
        dep.sample(4.0, before_s)
        hostile.send("flood", conns=FLOOD_CONNS, seconds=FLOOD_SECONDS, frame_bytes=FLOOD_FRAME)
        during: list = []
        while hostile.lines.empty():
            dep.sample(0.25, during)
        figures["flood"] = hostile.result()
        after_s: list = []
        dep.sample(6.0, after_s)
        base_rss = max(r for _, _, r in before_s)
        growth = max(r for _, _, r in during + after_s) - base_rss
        rate_before, rate_after = best_rate(before_s), best_rate(after_s)
        figures["flood"].update(
            rss_before_mib=round(base_rss / 2**20, 1), rss_growth_mib=round(growth / 2**20, 1),
            steps_per_s_before=round(rate_before, 2), steps_per_s_during=round(best_rate(during, 1.0), 2),
            steps_per_s_after=round(rate_after, 2),
        )  # fmt: skip
        assert growth <= RSS_BOUND, figures["flood"]
        if kind == "default":  # the kernel refused every connection: nothing ever reached the trainer
            assert figures["flood"]["raw_bytes_written"] == 0, figures["flood"]
        assert rate_after >= 0.5 * rate_before, ("the step rate did not come back", figures["flood"])

        # forged out-of-order sequence numbers
        figures["resets"] = hostile("resets", n=10)
        dep.wait_steps(3)
        m = dep.m()
        figures["resets"]["gaps"] = m["lmpipe_trainer_stale_batches_total[gap]"]
        figures["resets"]["producer_resets"] = [
            dep.producer_m(i)[f"lmpipe_producer_stream_resets_total[{i}]"] for i in range(PRODUCERS)
        ]
        assert figures["resets"]["gaps"] == 0 and figures["resets"]["producer_resets"] == [0, 0], figures
    finally:
        hostile.close()
        print(f"\n{kind} deployment under attack:")
        for name, fig in figures.items():
            print(f"  {name:9s} {json.dumps(fig)}")

    # the run goes on until it is told to stop, then accounts for every batch. Stale batches are those in
    # flight from shards that moved when the authorized producer joined and left (not_holder, duplicate):
    # none from another session, none out of order
    m = dep.m()
    assert m["lmpipe_trainer_stale_batches_total[old_session]"] == 0, m
    assert m["lmpipe_trainer_stale_batches_total[gap]"] == 0, m
    dep.trainer.send_signal(signal.SIGTERM)
    assert dep.trainer.wait(timeout=60) == 0, dep.log[-3000:]
    summary = json.loads(dep.summary.read_text())
    assert summary["stopped_by"] == "SIGTERM", summary
    assert summary["rejected"] == 0, summary
    figures["doc_log"] = check_doc_log(dep.doc_log, tok)
    print(f"  doc-log   {json.dumps(figures['doc_log'])}, {summary['steps']} steps")


def dep_fingerprint(tok) -> dict:
    """The pipeline's real fingerprint: the attacker is assumed to know the whole configuration."""
    cfg = PipelineConfig(builtin_docs=DOCS, epochs=0, producers=PRODUCERS)
    corpus = Corpus([], builtin_docs=DOCS, builtin_seed=0, vocab_size=tok.vocab_size)
    return fingerprint(cfg, tok.hash, tok.vocab_size, corpus.fingerprint())


def test_default_deployment_trains_only_its_own_producers(procs, tmp_path, tok):
    attack(procs, tmp_path, "default", tok)


def test_curve_deployment_trains_only_authorized_producers(procs, tmp_path, tok):
    attack(procs, tmp_path, "curve", tok)
