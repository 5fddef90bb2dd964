"""What several test modules share: real lmpipe processes, free ports, hostile input, doc-log accounting.

Plain functions and classes, no fixtures (those live in conftest.py, built on these). Tests import from here,
never from each other and never from bench/.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import zmq

from lmpipe.producer import builtin_corpus
from lmpipe.producer.stream import Doc
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.sockets import endpoints

REPO = Path(__file__).resolve().parent.parent
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"


# -- ports ------------------------------------------------------------------------------------------------


def free_ports(n: int, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A port p such that p..p+n-1 are free and none is in `avoid` (`lmpipe run` puts producer i's
    /metrics on port+1+i), and none was handed to another test of this session. A trainer on the default
    transport listens on ipc://.../<port>.data, not on the TCP port: without the reservation a test on the
    other xdist worker could be handed the same number while this one's producers still dial it, and a
    trainer there could admit them (then wait 60 s for their `bye`)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65535 or avoid & set(range(p, p + n)):
            continue
        try:
            for q in range(p + 1, p + n):
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", q))
        except OSError:
            continue
        if _reserve(range(p, p + n)):
            return p
    raise RuntimeError(f"no {n} consecutive free ports")


PORTS_DIR = "TEST_PORTS_OF_LMPIPE"  # names the session's reservations (conftest.py: made in pytest_configure)


def _reserve(ports: range) -> bool:
    """Claim `ports` for this test session, across its xdist workers (one file per port, created or not
    atomically); False when any was claimed before."""
    where = os.environ.get(PORTS_DIR)
    if where is None:  # helpers used outside pytest
        return True
    made: list[Path] = []
    for q in ports:
        claim = Path(where) / str(q)
        try:
            claim.touch(exist_ok=False)
        except FileExistsError:
            for f in made:  # the others go back
                f.unlink()
            return False
        made.append(claim)
    return True


def free_port_pair() -> int:
    """A data port p with p+1 (the control port) free too."""
    return free_ports(2)


# -- real processes ---------------------------------------------------------------------------------------


def lmpipe_env() -> dict[str, str]:
    # LMPIPE_FAST passes: scripts/gpu_check.sh runs the trainer tests once more with --fast none
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_") or k == "LMPIPE_FAST"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack (Procs.dump_stacks)
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


class Procs:
    """Real lmpipe processes started by a test; all are killed (group and all) at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, name: str = "proc", env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        p = subprocess.Popen(
            [sys.executable, "-m", "lmpipe", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or lmpipe_env(),
            cwd=REPO,
            start_new_session=True,
        )
        p.log_path = self.tmp / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    @staticmethod
    def log(p: subprocess.Popen) -> str:
        return Path(p.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def wait_for(self, p: subprocess.Popen, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(p):
                return
            if p.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not seen in {p.args} (rc={p.poll()}):\n{self.log(p)[-3000:]}")

    def wait(self, p: subprocess.Popen, timeout: float = 60) -> int:
        """The exit code; a process still running after `timeout` fails the test with its log's tail."""
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{p.args} still running after {timeout} s:\n{self.log(p)[-3000:]}"
            ) from None

    def dump_stacks(self) -> None:
        """After a failed test: every process still running is aborted (its faulthandler writes each
        thread's stack to its log) and the logs' tails are printed, so that a race seen once in CI shows
        where each process was waiting."""
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGABRT)
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for p in running:
            print(f"==== {p.args} was still running; its log's tail:\n{self.log(p)[-6000:]}")

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def small_run(port: int | None, **settings: object) -> list[str]:
    """The flags of a small real run or process on `port` (a free pair from the `port` fixture; None: the
    caller gives --port): the tiny model (the default preset), no metrics server, and `settings` as flags:
    steps=0 is `--steps 0`, doc_log=path `--doc-log path`, consume_only=True `--consume-only`; None or False
    leaves a flag out. A test names what its property needs (few steps, few documents, its tmp paths) and
    nothing else."""
    settings = {"metrics_port": -1, **settings}
    flags = [] if port is None else ["--port", str(port)]
    for name, value in settings.items():
        if value is None or value is False:
            continue
        flags.append("--" + name.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


def run_lmpipe(tmp: Path, name: str, *args: str, nproc: int = 0, timeout: float = 240) -> tuple[int, str]:
    """`lmpipe ARGS` as a process, under torchrun with `nproc` ranks when nproc > 0: (exit code, output)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd = [sys.executable, *(launcher if nproc else []), "-m", "lmpipe", *args]
    out = tmp / f"{name}.log"
    with open(out, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=lmpipe_env(),
                             start_new_session=True)  # fmt: skip
        try:
            rc = p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return rc, out.read_text(errors="replace")


def rank_logs(tmp: Path, stem: str) -> list[Path]:
    return sorted(tmp.glob(f"{stem}.rank*.jsonl"))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- in-memory documents ----------------------------------------------------------------------------------

PAD = 0


class ListStream:
    """A worker stream over documents given in memory (the batching code's only dependency)."""

    def __init__(self, docs: list[list[int]]):
        self.docs_ = [np.array(d, dtype=np.int64) for d in docs]
        self.tok = SimpleNamespace(pad_id=PAD)
        self.worker = 0

    def docs(self, epoch: int, start_pos: int = 0) -> Iterator[Doc]:
        for i in range(start_pos, len(self.docs_)):
            yield Doc(pos=i, doc_id=1000 + i, ids=self.docs_[i])


# -- hostile input ----------------------------------------------------------------------------------------

# Messages pushed straight at a trainer's data port: none is a valid batch, each must be counted as rejected.
GARBAGE = [[b"\x00\x01garbage"], [b"\x81\xa1v\x63"], [b"\x80", b"extra"], [os.urandom(3000)]]


def push_garbage(port: int, messages: list[list[bytes]] = GARBAGE) -> None:
    """Send `messages` to the data socket of the trainer on `port` (the default transport: its Unix socket,
    as this user) as a producer that never said hello would."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(endpoints(PipelineConfig(port=port)).data)
    for frames in messages:
        push.send_multipart(frames)
    push.close()
    ctx.term()


def write_bad_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A text file and a JSON-lines file, each with bad records among good ones (bad UTF-8, a 10 MiB line,
    broken JSON, records without text, negative token ids)."""
    txt = tmp_path / "a.txt"
    txt.write_bytes(
        b"first document\nsecond line\n\n"
        b"bad \xff\xfe line\nstill the second document\n\n"
        + b"x" * (10 * 1024 * 1024)
        + b"\n\nthird document\n\n\n\n\xc3\x28\n\nlast document\n"
    )
    jl = tmp_path / "b.jsonl"
    jl.write_text(
        "\n".join(
            [
                json.dumps({"text": "a good json document"}),
                '{"text": "broken',
                json.dumps({"text": "   "}),
                json.dumps({"title": "no text here"}),
                json.dumps({"ids": [1, 2, 3]}),
                json.dumps({"ids": [1, -5]}),
                "[1, 2]",
                json.dumps({"text": "the end"}),
            ]
        )
        + "\n"
    )
    return txt, jl


# -- the trainer's doc log (--doc-log): which document pieces each step trained ---------------------------

Pieces = dict[int, list[tuple[int, int]]]


def steps_logged(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def doc_log_entries(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line a kill -9 tore
            out.append(json.loads(line))
    return out


def doc_pieces(entries: list[dict]) -> Pieces:
    """doc id -> [(start, length), ...] over every step of `entries`."""
    pieces: Pieces = {}
    for e in entries:
        for b in e["batches"]:
            for did, start, n in b["docs"]:
                pieces.setdefault(did, []).append((start, n))
    return pieces


def read_doc_log(path: Path) -> Pieces:
    """doc id -> [(start, length), ...] over every trained step; a torn last line is ignored."""
    return doc_pieces(doc_log_entries(path))


def trained_pieces(entries: list[dict], first_session: str, resumed_step: int) -> Pieces:
    """The pieces that count after a kill and a resume from `resumed_step`: the steps the killed session
    took after that checkpoint are replayed by the next session, so they are left out."""
    pieces: Pieces = {}
    for e in entries:
        sessions = {b["session"] for b in e["batches"]}
        assert len(sessions) <= 1  # none: a rank whose shards finished stepped on nothing beside the others
        if sessions == {first_session} and e["step"] >= resumed_step:
            continue  # trained after the last checkpoint by the killed trainer: replayed later
        for b in e["batches"]:
            for did, start, n in b["docs"]:
                pieces.setdefault(did, []).append((start, n))
    return pieces


def assert_exactly_once(pieces: Pieces, expected_lengths: dict[int, int]) -> None:
    assert sorted(pieces) == sorted(expected_lengths), "every document arrived, and no other"
    for did, parts in pieces.items():
        covered = np.zeros(expected_lengths[did], dtype=np.int32)
        for start, n in parts:
            covered[start : start + n] += 1
        assert (covered == 1).all(), f"document {did}: tokens seen {sorted(set(covered.tolist()))} times"


def builtin_lengths(tok, n: int, seed: int = 0) -> dict[int, int]:
    """Token count of each of the first n built-in documents, end-of-text included."""
    encs = tok.tokenizer.encode_batch(
        [builtin_corpus.document(seed, i) for i in range(n)], add_special_tokens=False
    )
    return {i: len(e.ids) + 1 for i, e in enumerate(encs)}  # + end-of-text


def masked_packed_batch(L: int, seed: int):
    """Two packed rows of 97-token-vocabulary documents (5 random cuts each, the second row 7 tokens short)
    and a random loss mask: (tokens, lengths, seg, loss_mask) on the CPU."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 97, (2, L), generator=g)
    cuts = torch.randint(1, L, (2, 5), generator=g)
    seg = (torch.arange(L)[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.uint16)
    lengths = torch.tensor([L, L - 7], dtype=torch.int32)
    return tokens, lengths, seg, torch.randint(0, 2, (2, L), generator=g, dtype=torch.uint8)


def tiny_model(seed: int = 0, vocab: int = 97):
    """The smallest GPT preset, seeded, in eval mode (CPU model tests)."""
    import torch

    from lmpipe.consumer.model import GPT, preset

    torch.manual_seed(seed)
    return GPT(preset("tiny", vocab_size=vocab, block_size=64)).eval()


def run_in_triton_interpreter(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python with TRITON_INTERPRET=1 (read when a kernel is defined), from the repo root:
    a Triton kernel run on CPU. The code prints "ok" when its checks pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def compiled_bf16_steps(switch) -> list[tuple]:
    """One step of the tiny GPT on CUDA as the trainer runs it (torch.compile, FlexAttention over a packed
    batch with a loss mask, autocast bf16), with `switch(model, on)` off, then on: [(loss, grads), ...]."""
    import torch

    from lmpipe.consumer.inputs import build_inputs
    from lmpipe.consumer.model import GPT, preset

    L = 256
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=97, block_size=L)).cuda()
    tokens, lengths, seg, mask = (t.cuda() for t in masked_packed_batch(L, L))
    inp = build_inputs(tokens, lengths, seg, attention="flex", loss_mask=mask)
    results = []
    for on in (False, True):
        torch._dynamo.reset()
        switch(model, on)
        compiled = torch.compile(model, dynamic=False)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(inp.idx, inp.pos, inp.attn, inp.targets)[1]
        loss.backward()
        results.append((loss.detach().float(), [(n, p.grad.clone()) for n, p in model.named_parameters()]))
    return results


def run_stats(device, scaler=None):
    """A trainer's RunStats with its real metrics, started, on `device`; the feed's copy-time bookkeeping is
    the one part left out (observe_h2d)."""
    import torch
    from prometheus_client import CollectorRegistry

    from lmpipe.consumer.config import TrainConfig
    from lmpipe.consumer.distributed import Dist
    from lmpipe.consumer.runstats import RunStats
    from lmpipe.shared.metrics import TrainerMetrics

    feed = SimpleNamespace(observe_h2d=lambda: None)
    stats = RunStats(TrainConfig(log_every=1), Dist(), TrainerMetrics(CollectorRegistry()), feed,  # type: ignore[arg-type]
                     torch.device(device), scaler, (0.0, 0.0), 0.0, trained=True, started=time.perf_counter(),
                     step=0)  # fmt: skip
    stats.start_clock(0.0)
    return stats


def batch_meta(real_tokens: int, n_targets: int) -> SimpleNamespace:
    """What RunStats.add_step reads of a batch's SlotMeta."""
    return SimpleNamespace(real_tokens=real_tokens, n_targets=n_targets, pad_tokens=0)


# -- short documents ---------------------------------------------------------------------------------------

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "ran",
    "sat",
    "on",
    "mat",
    "big",
    "small",
    "red",
    "blue",
    "one",
    "two",
    ",",
    ".",
    ";",
    "(",
    ")",
    "=",
    "if",
    "x",
]


def short_texts(n: int, seed: int = 0) -> list[str]:
    """Documents of 1 to 6 words: many per packed row."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(n)]


# -- the command line in this process -------------------------------------------------------------------


@contextlib.contextmanager
def process_state() -> Iterator[None]:
    """What main() sets up for the process it runs in and a fresh process never gets back: the root logger
    (shared/log.py's setup) and the SIGINT/SIGTERM handlers (the launcher's). Put back afterwards, and the
    --checkpoint-dir locks it took let go, as its exit would."""
    import logging

    from lmpipe import checks

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    locks = len(checks._LOCKS)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for s, h in signals.items():
            signal.signal(s, h)
        while len(checks._LOCKS) > locks:
            os.close(checks._LOCKS.pop())


@contextlib.contextmanager
def cli_in_process(monkeypatch, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run `lmpipe.cli.main` here as a fresh process would: only `env` of LMPIPE_ variables, cwd the repo,
    os._exit raising SystemExit, the root logger and the signal handlers main() sets put back after."""

    def _exit(code: int) -> None:
        raise SystemExit(code)

    with monkeypatch.context() as m, process_state():
        for k in [k for k in os.environ if k.startswith("LMPIPE_")]:
            m.delenv(k)
        for k, v in (env or {}).items():
            m.setenv(k, v)
        m.chdir(REPO)
        m.setattr(os, "_exit", _exit)
        yield
