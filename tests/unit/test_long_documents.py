"""One huge document: tokenized in bounded pieces with the ids of the whole, and the producer heard meanwhile.

A text file without blank lines is one document. Encoding 60 MB of one in a single call took 10 GB and 40 s,
and a producer silent that long loses its shards to another, which tokenizes the same document again.
shared/tokenizer.py cuts long texts into pieces and calls the producer's keepalive between its encode calls.
Everything here uses the real built-in tokenizer; `spy` only records what each encode call is given.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import signal
import threading
import time

import pytest
import zmq

from lmpipe.producer import builtin_corpus, manager
from lmpipe.producer.sources import Corpus
from lmpipe.producer.stream import DocStream
from lmpipe.shared import messages, tokenizer
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import TRAINER_CONTROL, TRAINER_DATA, open_socket
from lmpipe.shared.tokenizer import CALL_CHARS, PIECE_CHARS, TokenizerInfo
from tests.helpers import WIKITEXT

SMALL_PIECE, SMALL_CALL = 512, 4096


def prose(chars: int, seed: int = 0) -> str:
    """At least `chars` characters of the built-in corpus (CI has no WikiText), a line per paragraph and no
    blank line: one document as a text file."""
    out: list[str] = []
    size = i = 0
    while size < chars:
        doc = "\n".join(line for line in builtin_corpus.document(seed, i).splitlines() if line.strip())
        out.append(doc)
        size += len(doc) + 1
        i += 1
    return "\n".join(out)


SEPARATORS = [" "] * 8 + ["  ", "   ", "\t", " \t", "\n", "\n\n", " \n", "\n ", "\r\n", "\u3000", "\xa0"]
UNICODE = [
    "naïve café", "Ελληνικά κείμενα", "Привет, мир!", "漢字かな交じり文", "العربية", "हिन्दी",
    "e\u0301 combining", "🙂👍🏽", "👩\u200d👩\u200d👧", "don't it's we'll", "3.14159 12345678", "x²+y²",
]  # fmt: skip


def whitespace_runs(chars: int) -> str:
    """Prose whose words are parted by runs of spaces, tabs, newlines, CRLF and Unicode spaces."""
    rng = random.Random(1)
    return "".join(w + rng.choice(SEPARATORS) for w in prose(chars, seed=1).split())


def unicode_mix(chars: int) -> str:
    rng = random.Random(2)
    words = prose(chars, seed=2).split()
    return " ".join(rng.choice(UNICODE) if rng.random() < 0.2 else w for w in words)


def wikitext(chars: int) -> str:
    path = WIKITEXT / "valid.txt"
    if not path.exists():
        pytest.skip("WikiText-2 not present beside the checkout")
    return path.read_text()[:chars]


class Spy:
    """The real tokenizer; records the length of every text each encode call is given, and the call."""

    def __init__(self, real):
        self.real = real
        self.calls: list[list[int]] = []
        self.events: list[str] = []  # "encode", and whatever a test adds in between

    def encode_batch_fast(self, texts, **kw):
        self.calls.append([len(t) for t in texts])
        self.events.append("encode")
        return self.real.encode_batch_fast(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def pieces(self) -> list[int]:
        return [n for call in self.calls for n in call]

    def whole(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text encoded whole, in one call (not recorded)."""
        return [e.ids for e in self.real.encode_batch(texts, add_special_tokens=False)]


@pytest.fixture
def spy(tok, monkeypatch) -> Spy:
    s = Spy(tok.tokenizer)
    monkeypatch.setattr(TokenizerInfo, "tokenizer", property(lambda self: s))
    return s


@pytest.fixture
def small_pieces(monkeypatch) -> None:
    """Pieces of at most SMALL_PIECE characters: hundreds of cuts in a text a test can afford."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", SMALL_PIECE)
    monkeypatch.setattr(tokenizer, "CUT_SEARCH", 128)
    monkeypatch.setattr(tokenizer, "CALL_CHARS", SMALL_CALL)


# -- the same ids, in bounded calls ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [prose, whitespace_runs, unicode_mix, wikitext])
def test_a_long_text_encoded_in_pieces_has_the_ids_of_the_whole_text(tok, spy, small_pieces, make):
    text = make(150_000)
    got = tok.encode_arrays([text])[0]
    assert got.tolist() == spy.whole([text])[0]
    pieces = spy.pieces()
    assert len(pieces) > 250 and max(pieces) <= SMALL_PIECE and sum(pieces) == len(text)
    assert max(map(sum, spy.calls)) <= SMALL_CALL


@pytest.mark.parametrize("minified", [True, False])
def test_text_without_whitespace_is_cut_hard_and_loses_nothing(tok, spy, small_pieces, minified):
    if minified:
        text = "".join(prose(60_000).split())
    else:  # binary-ish: any printable character but whitespace
        rng = random.Random(3)
        text = "".join(c for c in (chr(rng.randint(33, 0x7FF)) for _ in range(60_000)) if not c.isspace())
    got = tok.encode_arrays([text])[0].tolist()
    pieces = spy.pieces()
    assert max(pieces) == SMALL_PIECE and len(pieces) == -(-len(text) // SMALL_PIECE)
    assert tok.tokenizer.decode(got) == text  # byte-level: every character survives a hard cut
    assert abs(len(got) - len(spy.whole([text])[0])) <= 3 * len(pieces)  # only tokens at the cuts differ


def test_each_encode_call_gets_a_bounded_share_of_a_long_document_or_of_many_medium_ones(tmp_path, tok, spy):
    long = prose(CALL_CHARS + CALL_CHARS // 4)  # one document, more than a call's share
    medium = [prose(100_000, seed=s) for s in range(1, 17)]  # together more than a call's share too
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join([long, *medium]) + "\n")
    texts = [r.text or "" for r in Corpus([str(path)]).records()]
    assert len(texts) == 17 and len(texts[0]) > CALL_CHARS
    docs = list(DocStream(Corpus([str(path)]), tok, shuffle_window=0).docs(0))
    assert max(map(sum, spy.calls)) <= CALL_CHARS and max(spy.pieces()) <= PIECE_CHARS
    assert len(spy.calls) >= 3 and sum(spy.pieces()) == sum(map(len, texts))
    want = spy.whole(texts[:1]) + spy.whole(texts[1:])
    assert [d.ids[:-1].tolist() for d in docs] == want
    assert all(d.ids[-1] == tok.eos_id for d in docs)


def test_the_stream_calls_keepalive_after_every_encode_call(tmp_path, tok, spy, small_pieces):
    path = tmp_path / "one.txt"
    path.write_text(prose(20_000) + "\n")
    stream = DocStream(Corpus([str(path)]), tok, keepalive=lambda: spy.events.append("keepalive"))
    (doc,) = stream.docs(0)
    n = spy.events.count("encode")
    assert n >= 5 and spy.events == ["encode", "keepalive"] * n


# -- the producer's hello while it tokenizes ---------------------------------------------------------------


class StandIn:
    """A real producer on a one-document corpus, its run() in a thread, and a stand-in trainer on real
    sockets that has assigned and welcomed shard 0 (stand_in_trainer)."""

    def __init__(self, producer: manager.Producer, router: zmq.Socket, pull: zmq.Socket):
        self.producer, self.router, self.pull = producer, router, pull
        self.exits: list[int] = []
        self.thread = threading.Thread(target=lambda: self.exits.append(producer.run()), daemon=True)
        self.heard: list = []  # control messages from the producer, in order
        self.ident = b""

    def drain(self, timeout_ms: int = 0) -> None:
        """Hellos read as they come: none waits in a full queue."""
        while self.router.poll(timeout_ms):
            self.heard.append(messages.unpack(self.router.recv_multipart()[1]))

    def send(self, msg) -> None:
        self.router.send_multipart([self.ident, messages.pack(msg)])


@contextlib.contextmanager
def stand_in_trainer(tmp_path, port, text: str, prepare=lambda p: None):
    """`prepare(producer)` runs before the producer's loop starts (to wrap its methods)."""
    path = tmp_path / "one.txt"
    path.write_text(text + "\n")
    cfg = PipelineConfig(
        data=[str(path)], port=port, producers=1, epochs=1, runtime_dir=str(tmp_path / "run")
    )
    p = manager.Producer(cfg, manager.ProducerOptions())
    prepare(p)
    ctx = zmq.Context()
    t = StandIn(
        p,
        open_socket(ctx, TRAINER_CONTROL, cfg, p.endpoints),
        open_socket(ctx, TRAINER_DATA, cfg, p.endpoints),
    )
    t.thread.start()
    try:
        assert t.router.poll(20_000), "no hello from the producer"
        t.ident, raw = t.router.recv_multipart()
        t.heard.append(messages.unpack(raw))
        t.send(messages.Assign("s", [0], 1, 1))
        t.send(messages.Welcome("s", 0, lease="L", shards=1))
        yield t
    finally:
        p.request_stop()
        t.thread.join(20)
        t.router.close(0)
        t.pull.close(0)
        ctx.term()


def test_the_hellos_go_on_while_one_long_document_is_tokenized(
    tmp_path, port, cue, small_pieces, monkeypatch
):
    """A real producer loop and a stand-in trainer on real sockets. The control connection has a thread of
    its own: the producer's main thread held inside the tokenizer (an encode call that returns only once the
    trainer has heard three more hellos) does not silence the heartbeat, and the hellos name the shard."""
    monkeypatch.setattr(manager, "HELLO_EVERY", 0.2)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:  # in the producer's main thread, inside the tokenizer's loop
        inside.set()
        assert release.wait(120), "the trainer heard no hellos meanwhile"

    cue.at[STOP_AT] = hold
    with stand_in_trainer(tmp_path, port, prose(200_000)) as t:
        assert inside.wait(60), "the tokenizer was not reached"
        t.drain()
        before = len(t.heard)
        deadline = time.monotonic() + 60
        while sum(isinstance(m, messages.Hello) and m.holding == [0] for m in t.heard[before:]) < 3:
            assert time.monotonic() < deadline, t.heard[before:]
            t.drain(100)
        release.set()
        t.send(messages.Stop("test over"))
        t.thread.join(20)
        assert t.exits == [0]
        t.drain(1000)
    assert len(cue.calls) < 100, "stopped mid-document"
    assert isinstance(t.heard[-1], messages.Bye)


# -- a tiny corpus's notices -------------------------------------------------------------------------------


def test_shards_of_a_tiny_corpus_say_single_document_once(tmp_path, tok, caplog):
    path = tmp_path / "eight.txt"
    path.write_text("".join(f"line {i}\n" for i in range(8)))
    with caplog.at_level(logging.WARNING, logger="lmpipe.producer"):
        for w in range(8):
            list(DocStream(Corpus([str(path)], doc_split="line"), tok, w, 8).docs(0))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("shard 0 of 8 owns a single document") and "said once" in line


# -- a stop while a long document is tokenized -------------------------------------------------------------

STOP_AT = 3  # the encode call after which a stop comes


class Cue(Spy):
    """The spy, and at chosen encode calls (counted from 1) an action in the producer's thread: a control
    message from the stand-in trainer (`sends`), waited for until it is readable at the producer's control
    socket and queued by its control thread before the call returns, so the check after the call can see it
    (nothing left to the clock);
    a stop as the signal handler makes it; or a function to call. `events` also records each control message
    the producer handles."""

    def __init__(self, real):
        super().__init__(real)
        self.at: dict[int, object] = {}  # call -> a message, "signal", or a function
        self.sends: queue.Queue = queue.Queue()
        self.producer: manager.Producer | None = None

    def encode_batch_fast(self, texts, **kw):
        out = super().encode_batch_fast(texts, **kw)
        what, p = self.at.get(len(self.calls)), self.producer
        if what == "signal":
            assert p is not None
            p.request_stop(signal.SIGTERM)
        elif callable(what):
            what()
        elif what is not None:
            assert p is not None and p._channel is not None
            before = p._channel.inbox.qsize()  # nothing takes from it meanwhile: its reader is this thread
            self.sends.put(what)
            deadline = time.monotonic() + 20
            while p._channel.inbox.qsize() == before:
                assert time.monotonic() < deadline, "the message did not arrive"
                time.sleep(0.01)
        return out


@pytest.fixture
def cue(tok, monkeypatch) -> Cue:
    c = Cue(tok.tokenizer)
    monkeypatch.setattr(TokenizerInfo, "tokenizer", property(lambda self: c))
    return c


def serve_one_document(tmp_path, port, cue: Cue, monkeypatch, text: str) -> tuple[list[int], list, bool]:
    """stand_in_trainer, then whatever `cue` sends, until the producer's run() returns. (exit codes, the
    control messages heard, whether any batch arrived)."""

    def spied_control(p: manager.Producer) -> None:
        cue.producer, handle = p, p._control

        def control(raw):
            cue.events.append(f"control {type(messages.unpack(raw)).__name__}")
            return handle(raw)

        monkeypatch.setattr(p, "_control", control)

    with stand_in_trainer(tmp_path, port, text, spied_control) as t:
        deadline = time.monotonic() + 120
        while t.thread.is_alive():
            assert time.monotonic() < deadline, "the producer did not stop"
            t.drain()
            with contextlib.suppress(queue.Empty):
                t.send(cue.sends.get(timeout=0.05))
        t.drain(1000)  # the bye, if any, was queued before run() returned
        batch = bool(t.pull.poll(0))
    return t.exits, t.heard, batch


def handled(cue: Cue) -> list[str]:
    """The encode calls and control messages handled, in order, runs of encode calls counted."""
    out: list[str] = []
    n = 0
    for e in cue.events:
        if e == "encode":
            n += 1
            continue
        if n:
            out.append(f"{n} encode")
            n = 0
        out.append(e)
    return out + ([f"{n} encode"] if n else [])


def test_the_trainers_stop_ends_a_long_tokenization_at_the_next_encode_call(
    tmp_path, port, cue, small_pieces, monkeypatch
):
    """The stop is read between two encode calls of a document that takes dozens: the producer drops the
    batch it was building (never sent: the trainer's cursors say where the shard resumes) and says bye."""
    cue.at[STOP_AT] = messages.Stop("test over")
    exits, heard, batch = serve_one_document(tmp_path, port, cue, monkeypatch, prose(200_000))
    assert exits == [0]
    assert handled(cue) == ["control Assign", "control Welcome", f"{STOP_AT} encode", "control Stop"]
    assert isinstance(heard[-1], messages.Bye) and not batch


def test_a_refusal_read_mid_document_ends_the_producer_at_the_next_encode_call(
    tmp_path, port, cue, small_pieces, monkeypatch, caplog
):
    """The trainer's `refuse` (here after it was restarted with another config) read between two encode calls
    of a document that takes dozens: the producer gives up at once with exit 2 and the reason, as a refusal
    at the handshake does; the batch being built is dropped, never sent."""
    cue.at[STOP_AT] = messages.Refuse("config mismatch: seq_len: this producer 64, the trainer 128")
    with caplog.at_level(logging.ERROR, logger="lmpipe.producer"):
        exits, _heard, batch = serve_one_document(tmp_path, port, cue, monkeypatch, prose(200_000))
    assert exits == [2]
    assert handled(cue) == ["control Assign", "control Welcome", f"{STOP_AT} encode", "control Refuse"]
    assert not batch
    assert "trainer refused this producer: config mismatch: seq_len" in caplog.text


def test_a_signal_ends_a_long_tokenization_at_the_next_encode_call(
    tmp_path, port, cue, small_pieces, monkeypatch
):
    """SIGTERM or SIGINT to a producer (its handler: request_stop) mid-document: it stops after the encode
    call running then, not after the whole document."""
    cue.at[STOP_AT] = "signal"
    exits, heard, batch = serve_one_document(tmp_path, port, cue, monkeypatch, prose(200_000))
    assert exits == [0] and cue.producer is not None and cue.producer.interrupted
    assert handled(cue) == ["control Assign", "control Welcome", f"{STOP_AT} encode"]
    assert not batch


def test_other_control_messages_read_mid_document_wait_for_the_batch_then_come_in_order(
    tmp_path, port, cue, small_pieces, monkeypatch, tok
):
    """A welcome that restarts the shard, read by the control thread mid-document, is handled only once the
    batch is built (the holdings are mid-update until then), before it is sent: the document is tokenized
    again from the shard's start, and a stop read during that second pass still ends it at once."""
    text = prose(200_000)
    probe = tmp_path / "probe.txt"
    probe.write_text(text + "\n")
    (rec,) = Corpus([str(probe)]).records()
    tok.encode_arrays([rec.text or ""])  # how many calls the document takes
    per_document = len(cue.calls)
    cue.calls.clear()
    cue.events.clear()
    assert per_document > 2 * STOP_AT
    cue.at[STOP_AT] = messages.Welcome("s", 0, lease="L", shards=1, force=True)
    cue.at[per_document + STOP_AT] = messages.Stop("test over")
    exits, heard, batch = serve_one_document(tmp_path, port, cue, monkeypatch, text)
    assert exits == [0]
    assert handled(cue) == [
        "control Assign",
        "control Welcome",
        f"{per_document} encode",
        "control Welcome",
        f"{STOP_AT} encode",
        "control Stop",
    ]
    assert isinstance(heard[-1], messages.Bye) and not batch


# -- the trainer gone while a long document is tokenized ---------------------------------------------------

LOST = "lost the connection to the trainer"


class EventLog(logging.Handler):
    """The producer's log lines that say `wanted`, as events beside the encode calls (same thread)."""

    def __init__(self, events: list[str], *wanted: str):
        super().__init__(logging.INFO)
        self.events, self.wanted = events, wanted

    def emit(self, record: logging.LogRecord) -> None:
        self.events += [f"log {w}" for w in self.wanted if w in record.getMessage()]


def calls_per_document(tmp_path, tok, cue: Cue, text: str) -> int:
    probe = tmp_path / "probe.txt"
    probe.write_text(text + "\n")
    (rec,) = Corpus([str(probe)]).records()
    tok.encode_arrays([rec.text or ""])
    n = len(cue.calls)
    cue.calls.clear()
    cue.events.clear()
    return n


def serve_through_a_drop(
    tmp_path,
    port,
    cue: Cue,
    monkeypatch,
    caplog,
    text: str,
    per_document: int,
    hellos: bool,
    before_stop=None,
) -> bool:
    """stand_in_trainer on `text`, with `cue`'s actions; "trainer gone" closes the stand-in trainer's control
    socket, and the cue waits until the producer's control thread has logged the drop (nothing is left to the
    clock).
    Runs until the producer has logged the drop and made the `per_document` encode calls of the document,
    then stops it. `hellos`: each hello the producer builds is an event ("hello", or "hello rejoin").
    Whether a batch reached the trainer."""
    gone = threading.Event()

    def trainer_gone() -> None:  # in the producer's thread, after the encode call cued
        cue.sends.put("trainer gone")
        assert gone.wait(20), "the stand-in trainer did not close its socket"
        deadline = time.monotonic() + 20
        while f"log {LOST}" not in cue.events:
            assert time.monotonic() < deadline, "the producer's control thread saw nothing"
            time.sleep(0.01)

    for k, what in cue.at.items():
        if what == "trainer gone":
            cue.at[k] = trainer_gone

    def spied(p: manager.Producer) -> None:
        cue.producer, build, handle = p, p._hello, p._control

        def hello(skipped=None):
            raw = build(skipped)
            cue.events.append("hello rejoin" if messages.unpack(raw).rejoin else "hello")
            return raw

        def control(raw):
            cue.events.append(f"control {type(messages.unpack(raw)).__name__}")
            return handle(raw)

        if hellos:
            monkeypatch.setattr(p, "_hello", hello)
        monkeypatch.setattr(p, "_control", control)

    said = EventLog(cue.events, LOST, "welcomed this producer back")
    logger = logging.getLogger("lmpipe.producer")
    logger.addHandler(said)
    try:
        with (
            caplog.at_level(logging.INFO, logger="lmpipe.producer"),
            stand_in_trainer(tmp_path, port, text, spied) as t,
        ):
            deadline = time.monotonic() + 120
            while f"log {LOST}" not in cue.events or cue.events.count("encode") < per_document:
                assert time.monotonic() < deadline, f"no document tokenized, or no drop said: {handled(cue)}"
                assert t.thread.is_alive(), t.exits
                with contextlib.suppress(queue.Empty):
                    what = cue.sends.get(timeout=0.05)
                    if what == "trainer gone":
                        t.drain()
                        t.router.close(0)  # the trainer's process ends: its connection closes
                        gone.set()
                    else:
                        t.send(what)
            if before_stop is not None:
                before_stop()
            batch = bool(t.pull.poll(200))
    finally:
        logger.removeHandler(said)
    assert t.exits == [0]
    return batch


def test_a_trainer_gone_mid_document_is_noticed_while_it_is_tokenized(
    tmp_path, port, cue, small_pieces, monkeypatch, tok, caplog
):
    """The trainer's control socket closes after encode call STOP_AT of a document that takes dozens. The
    control thread notices at once, while the main thread is still inside the tokenizer: logged then (the cue
    waits for the line before the next encode call), the hellos from there on say `rejoin`, and the batch
    built is held, not sent."""
    monkeypatch.setattr(manager, "HELLO_EVERY", 0.05)
    text = prose(200_000)
    per_document = calls_per_document(tmp_path, tok, cue, text)
    assert per_document > 2 * STOP_AT
    cue.at[STOP_AT] = "trainer gone"
    batch = serve_through_a_drop(tmp_path, port, cue, monkeypatch, caplog, text, per_document, hellos=True)
    events = [e for e in cue.events if not e.startswith("control")]
    lost = events.index(f"log {LOST}")
    assert events[:lost].count("encode") == STOP_AT, handled(cue)  # noticed before the next encode call
    assert "hello" not in events[lost:], "a hello after the drop did not say rejoin"
    assert not batch, "a batch went to the trainer that was gone"


def test_a_drop_after_a_message_kept_for_the_loop_takes_effect_after_it(
    tmp_path, port, cue, small_pieces, monkeypatch, tok, caplog
):
    """A welcome that restarts the shard is read mid-document (kept for the loop: the holdings are mid-update),
    then the trainer goes away (logged by the control thread when it happens). Handled as they came: the
    welcome once the batch is built, then the drop, which holds the restarted shard. The drop taken before
    the welcome would have been undone by it ("the trainer welcomed this producer back"), and the producer
    would have gone on tokenizing."""
    text = prose(200_000)
    per_document = calls_per_document(tmp_path, tok, cue, text)
    assert per_document > 2 * STOP_AT
    cue.at[STOP_AT] = messages.Welcome("s", 0, lease="L", shards=1, force=True)
    cue.at[STOP_AT + 1] = "trainer gone"

    def held_then_stop() -> bool:
        p = cue.producer
        assert p is not None
        deadline = time.monotonic() + 20
        while not p._held:
            assert time.monotonic() < deadline, "the drop did not hold the batches"
            time.sleep(0.01)
        return True

    batch = serve_through_a_drop(
        tmp_path, port, cue, monkeypatch, caplog, text, per_document, hellos=False, before_stop=held_then_stop
    )
    assert handled(cue) == [
        "control Assign",
        "control Welcome",
        f"{STOP_AT + 1} encode",
        f"log {LOST}",
        f"{per_document - STOP_AT - 1} encode",
        "control Welcome",
    ]
    assert not batch
