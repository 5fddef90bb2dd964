"""A real trainer's wait line names what connected producers wait on (Hello.waiting, issue 44), here from
a stand-in producer that says hello every second but sends no batch, as one retrying storage does."""

from __future__ import annotations

import os
import socket
import time

import zmq

from lmpipe.producer.sources import Corpus
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig, fingerprint
from lmpipe.shared.sockets import endpoints
from lmpipe.shared.wire import WIRE_VERSION

DOCS = 100
RETRY = "storage (s3://corpora/shards, retry 3 of 7)"


def test_the_wait_line_names_producers_waiting_on_storage(procs, port, tok):
    train = procs.start("train", "--builtin-docs", str(DOCS), "--epochs", "1", "--producers", "1",
                        "--port", str(port), "--metrics-port", "-1", "--steps", "0", name="trainer")  # fmt: skip
    procs.wait_for(train, "listening on")
    cfg = PipelineConfig(builtin_docs=DOCS, epochs=1, producers=1)
    corpus = Corpus([], builtin_docs=DOCS, builtin_seed=0, vocab_size=tok.vocab_size)
    fp = fingerprint(cfg, tok.hash, tok.vocab_size, corpus.fingerprint())
    hello = messages.Hello(fingerprint=fp, pid=os.getpid(), host=socket.gethostname(), wire=WIRE_VERSION,
                           waiting=RETRY)  # fmt: skip
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoints(PipelineConfig(port=port)).control)
    answers = []
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "waiting for batches" not in procs.log(train):
            dealer.send(messages.pack(hello))
            while dealer.poll(1000 if not answers else 0):
                answers.append(type(messages.unpack(dealer.recv())).__name__)
            time.sleep(max(0.0, 1.0 - (time.monotonic() % 1.0)))
    finally:
        dealer.close()
        ctx.term()
    assert "Assign" in answers, answers
    line = next(x for x in procs.log(train).splitlines() if "waiting for batches" in x)
    assert line.endswith(f"waiting for batches: 1 producer(s) connected; producer #0 waiting on {RETRY}"), (
        line
    )
