"""A real producer process serving a two-source mixture to a stand-in trainer on real sockets (a ROUTER and a
PULL speaking the real messages): it sends nothing past its credit and goes on when granted more, while its
hellos keep coming; each shard carries its own source's documents; a source with epochs = 1 ends with
`end`, one with epochs = 0 passes into epoch 1 in another order; and a source keeps its format, its
compression and object storage."""

from __future__ import annotations

import gzip
import json
import time

import zmq

from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import TRAINER_CONTROL, TRAINER_DATA, endpoints, open_socket
from lmpipe.shared.tokenizer import load_tokenizer
from lmpipe.shared.wire import decode
from tests.helpers import lmpipe_env, small_run
from tests.s3server import S3Server

PER_SOURCE = 2  # shards per source: shards 0, 1 are source a's, 2, 3 source b's
A_DOCS, B_DOCS = 16, 24


def _corpus(tmp_path, word: str, n: int):
    path = tmp_path / f"{word}.jsonl"
    path.write_text("".join(json.dumps({"text": f"{word} {word} {word} {i}"}) + "\n" for i in range(n)))
    return path


class StandIn:
    """The trainer's side of the sockets, bound before the producer starts."""

    def __init__(self, cfg: PipelineConfig):
        self.ctx = zmq.Context()
        ep = endpoints(cfg)
        self.router = open_socket(self.ctx, TRAINER_CONTROL, cfg, ep)
        self.pull = open_socket(self.ctx, TRAINER_DATA, cfg, ep)
        self.ident = b""
        self.hellos = 0
        self.hello: messages.Hello | None = None  # the last one
        self.got: dict[int, list] = {s: [] for s in range(2 * PER_SOURCE)}  # shard -> its messages (decoded)

    def send(self, msg) -> None:
        self.router.send_multipart([self.ident, messages.pack(msg)])

    def pump(self, seconds: float) -> int:
        """Read control and data for `seconds`; the number of data messages read."""
        n, deadline = 0, time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                if sock is self.router:
                    self.ident, raw = self.router.recv_multipart()
                    msg = messages.unpack(raw)
                    if isinstance(msg, messages.Hello):
                        self.hellos, self.hello = self.hellos + 1, msg
                else:
                    msg = decode(self.pull.recv_multipart())
                    self.got[msg.header["shard"]].append(msg)
                    n += 1
        return n

    def until(self, cond, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}: {[len(v) for v in self.got.values()]}"
            self.pump(0.1)

    def close(self) -> None:
        self.router.close(0)
        self.pull.close(0)
        self.ctx.term()


def test_a_mixture_producer_serves_each_source_paced_by_credits(tmp_path, port, procs):
    a, b = _corpus(tmp_path, "alpha", A_DOCS), _corpus(tmp_path, "omega", B_DOCS)
    mix = tmp_path / "mix.toml"
    mix.write_text(
        f"[sources.a]\ndata = ['{a}']\nweight = 1\nepochs = 1\n[sources.b]\ndata = ['{b}']\nweight = 3\nepochs = 0\n"
    )
    run = tmp_path / "run"
    cfg = PipelineConfig(
        mix_file=str(mix), port=port, runtime_dir=str(run), strategy="pad", seq_len=32, batch_size=2
    )
    t = StandIn(cfg)
    p = procs.start(
        "produce", *small_run(port, mix_file=mix, runtime_dir=run, strategy="pad", seq_len=32, batch_size=2),
        name="producer",
    )  # fmt: skip
    try:
        t.until(lambda: t.hello is not None, "no hello")
        # the hello names the sources (not their weights), and each source's files
        assert t.hello is not None
        hello_fp = t.hello.fingerprint
        assert hello_fp["mix"] == "a:epochs=1;b:epochs=0"
        assert list(json.loads(hello_fp["data"])) == ["a", "b"]

        shards = list(range(2 * PER_SOURCE))
        t.send(messages.Assign("s", shards, len(shards), 1))
        for s in shards:
            t.send(messages.Welcome("s", s, lease=f"L{s}", shards=len(shards), credit=2))
        # (a) two messages a shard, then nothing while hellos keep coming
        t.until(lambda: all(len(t.got[s]) == 2 for s in shards), "the first credit's messages")
        hellos = t.hellos
        assert t.pump(2.5) == 0, "sent past its credit"
        assert t.hellos > hellos, "no hellos while it waited for credit"
        assert all([m.header["seq"] for m in t.got[s]] == [1, 2] for s in shards)
        # granted more: it goes on, each shard up to its credit
        granted = {s: 2 for s in shards}

        def grant(upto: int) -> None:
            for s in shards:
                granted[s] = upto
            t.send(messages.Credit("s", dict(granted)))

        grant(4)
        t.until(lambda: all(len(t.got[s]) == 4 for s in shards), "the second credit's messages")
        # the rest: a's shards end (8 documents, 4 batches, then `end`), b's go on into epoch 1
        a_done = lambda: all(t.got[s][-1].header["kind"] == "end" for s in (0, 1))  # noqa: E731
        b_epoch1 = lambda: all(t.got[s][-1].header["cursor"]["epoch"] >= 1 for s in (2, 3))  # noqa: E731
        upto = 4
        while not (a_done() and b_epoch1()):
            upto += 2
            grant(upto)
            t.until(lambda n=upto: all(len(t.got[s]) == n or t.got[s][-1].header["kind"] == "end" for s in shards),
                    f"the messages up to seq {upto}")  # fmt: skip
            assert upto < 40, "a's shards never ended or b's never reached epoch 1"
        assert t.pump(0.5) == 0
        for s in shards:
            seqs = [m.header["seq"] for m in t.got[s]]
            assert seqs == list(range(1, len(seqs) + 1)) and seqs[-1] <= granted[s], (s, seqs)
            assert all(m.header["lease"] == f"L{s}" and m.header["session"] == "s" for m in t.got[s])

        # (b) each shard carries its own source's documents, and the shards of a source share them out
        tok = load_tokenizer().tokenizer
        for s in shards:
            word, other = ("alpha", "omega") if s < PER_SOURCE else ("omega", "alpha")
            for m in t.got[s]:
                for row, n in zip(m.arrays.get("tokens", []), m.arrays.get("lengths", [])):
                    text = tok.decode([int(x) for x in row[:n]])
                    assert word in text and other not in text, (s, text)
        a_docs = [
            int(d)
            for s in (0, 1)
            for m in t.got[s]
            if m.header["kind"] == "batch"
            for d in m.arrays["doc_id"]
        ]
        assert sorted(a_docs) == list(range(A_DOCS)), "source a: every document once in its one epoch"

        # (c) b's shard passes into epoch 1 with its documents in another order
        for s in (2, 3):
            by_epoch: dict[int, list[int]] = {0: [], 1: []}
            for m in t.got[s]:
                if m.header["cursor"]["epoch"] in by_epoch:
                    by_epoch[m.header["cursor"]["epoch"]] += [int(d) for d in m.arrays["doc_id"]]
            assert sorted(by_epoch[0]) == [d for d in range(B_DOCS) if d % PER_SOURCE == s - PER_SOURCE]
            n = len(by_epoch[1])
            assert n >= 2 and by_epoch[1] != by_epoch[0][:n], (s, by_epoch)

        t.send(messages.Stop("test over"))
        assert procs.wait(p, 30) == 0
    finally:
        t.close()


def test_each_source_keeps_its_format_compression_and_object_storage(tmp_path, port, procs):
    """A local gzip-compressed JSONL source beside a source of two objects on a real S3-compatible server
    (moto's, its own process): each shard carries its own source's documents, every document of each source
    once in its one epoch, then `end`; the hello pins the remote objects' versions."""
    root = tmp_path / "s3"
    (root / "mix" / "code").mkdir(parents=True)
    for k in range(2):
        lines = "".join(
            json.dumps({"text": f"omega omega {k} {i}"}) + "\n" for i in range(k * 10, k * 10 + 10)
        )
        (root / "mix" / "code" / f"part-{k}.jsonl").write_text(lines)
    with gzip.open(tmp_path / "web.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"alpha alpha {i}"}) + "\n" for i in range(A_DOCS)))
    server = S3Server(root, tmp_path / "s3.log")
    server.start()
    env = {**lmpipe_env(), **server.env()}
    run = tmp_path / "run"
    cfg = PipelineConfig(port=port, runtime_dir=str(run))
    t = StandIn(cfg)
    try:
        p = procs.start(
            "produce", *small_run(port, runtime_dir=run, strategy="pad", seq_len=32, batch_size=2, epochs=1),
            "--mix", f"web={tmp_path / 'web.jsonl.gz'}:1", "code=s3://mix/code/:1", name="producer", env=env,
        )  # fmt: skip
        t.until(lambda: t.hello is not None, "no hello")
        assert t.hello is not None and messages.VERSIONS_SHAPE.fullmatch(t.hello.data_versions)
        shards = list(range(2 * PER_SOURCE))
        t.send(messages.Assign("s", shards, len(shards), 1))
        for s in shards:
            t.send(messages.Welcome("s", s, lease=f"L{s}", shards=len(shards), credit=100))
        t.until(lambda: all(t.got[s] and t.got[s][-1].header["kind"] == "end" for s in shards), "the ends")
        tok = load_tokenizer().tokenizer
        texts: dict[str, list[str]] = {"alpha": [], "omega": []}
        for s in shards:
            word, other = ("alpha", "omega") if s < PER_SOURCE else ("omega", "alpha")
            for m in t.got[s][:-1]:
                for row, n in zip(m.arrays["tokens"], m.arrays["lengths"]):
                    text = tok.decode([int(x) for x in row[:n]])
                    assert word in text and other not in text, (s, text)
                    texts[word].append(text.split()[-1])
        assert sorted(map(int, texts["alpha"])) == list(range(A_DOCS))
        assert sorted(map(int, texts["omega"])) == list(range(20))
        t.send(messages.Stop("test over"))
        assert procs.wait(p, 30) == 0
    finally:
        t.close()
        server.kill()
