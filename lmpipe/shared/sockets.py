"""Every ZeroMQ socket lmpipe opens is made here: which transport, who may connect, and its limits.

Transport (`endpoints`), decided the same way on both sides from --host, --curve-dir and --trusted-network:
- loopback --host (the default) and neither flag: `ipc://` Unix sockets `<port>.data` and `<port>.ctl` in a
  runtime directory private to this user (--runtime-dir, else $XDG_RUNTIME_DIR/lmpipe, else
  /tmp/lmpipe-<uid>), mode 0700. The kernel refuses every other user at connect(), before ZeroMQ reads a
  byte: nobody else can deliver a batch, an `end` or a hello, or make the trainer buffer anything.
  `lmpipe train` and `lmpipe produce` started by one user meet there with no extra flag; --port still
  separates runs (the trainer holds `<port>.lock`, so a second trainer on the same port is refused instead
  of silently taking the socket files over).
- --curve-dir: `tcp://host:port` and port+1 with CURVE; the trainer's ZAP handler (shared/security.py)
  admits only keys in `authorized/`, so other peers are cut off during the handshake.
- --trusted-network: plain `tcp://`; whoever can reach the ports is trusted (a private network, a tunnel).

Socket options (`open_socket`), one function for every socket of both sides:

  role              type    limits                                         liveness
  trainer data      PULL    RCVHWM 4, RCVBUF 2 batches, MAXMSGSIZE         no heartbeats (see below)
  trainer control   ROUTER  RCVHWM 64, MAXMSGSIZE 64 KiB, ROUTER_HANDOVER  heartbeats
  producer data     PUSH    SNDHWM 4, SNDBUF 2 batches, IMMEDIATE          no heartbeats
  producer control  DEALER  MAXMSGSIZE 64 KiB, IMMEDIATE, own ROUTING_ID   heartbeats

All: LINGER 0, a 10 s handshake limit, CURVE keys with --curve-dir. Small HWMs and buffers make a slow
trainer stop the producers' tokenizers instead of filling anyone's memory; per connection the trainer
holds at most RCVHWM messages of at most MAXMSGSIZE bytes, plus the kernel's buffer. No heartbeats on data
sockets: a trainer busy for seconds (or a starved CPU) must not look dead and lose the batches queued on
the connection; a crashed peer closes its socket anyway. On control sockets, ZMTP heartbeats (a PING
every 2 s, 30 s without an answer) turn a frozen or unreachable peer into a closed connection, which the
trainer watches for (consumer/connections.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zmq

from lmpipe.shared.batch import batch_bytes
from lmpipe.shared.config import PipelineConfig, is_loopback
from lmpipe.shared.security import client_sockets, server_sockets

SEND_HWM = 4  # batches a producer queues before send blocks
RECV_HWM = 4  # batches the trainer queues per producer connection
CONTROL_HWM = 64  # control messages queued per peer (a producer sends one hello a second)
CONTROL_MAX_BYTES = 64 * 1024
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 30_000  # a peer silent this long after a PING is disconnected (the ROUTER notices)
HANDSHAKE_MS = 10_000  # a connection that has not authenticated by then is closed
MAX_HANDSHAKE_FAILURES = 9  # broken handshakes in a row (~1 s of reconnects) before a producer gives up
# A producer reconnects 10-20 ms after a failed attempt, then backs off to ~0.2 s: one started with its
# trainer (`lmpipe run` forks them first) connects as soon as the trainer listens, where libzmq's default
# (100-200 ms, every time) was most of the time to the first batch.
RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 10, 200
log = logging.getLogger("lmpipe.sockets")
UNIX_PATH_MAX = (
    107  # sun_path is 108 bytes with its NUL on Linux (104 on macOS; long paths fail there at bind)
)


@dataclass(frozen=True)
class Role:
    type: int
    bind: bool
    data: bool


TRAINER_DATA = Role(zmq.PULL, bind=True, data=True)
TRAINER_CONTROL = Role(zmq.ROUTER, bind=True, data=False)
PRODUCER_DATA = Role(zmq.PUSH, bind=False, data=True)
PRODUCER_CONTROL = Role(zmq.DEALER, bind=False, data=False)


@dataclass
class Endpoints:
    """Where the trainer listens and producers connect, and how peers are authenticated there."""

    data: str
    control: str
    kind: str  # "ipc" (this user only), "curve" or "trusted"
    runtime_dir: Path | None = None
    curve_dir: str | None = None
    _lock: IO[str] | None = field(default=None, repr=False)

    def describe(self) -> str:
        how = {
            "ipc": "Unix sockets only this user can reach",
            "curve": "CURVE: authorized producer keys only",
            "trusted": "unauthenticated: --trusted-network",
        }[self.kind]
        return f"{self.data} ({how})"

    def claim(self, port: int) -> None:
        """Trainer side, before binding ipc sockets: hold `<port>.lock` while the sockets are open.
        ZeroMQ unlinks an existing socket file when it binds, so without this a second trainer on the same
        port would silently take the first one's producers."""
        if self.kind != "ipc" or self._lock is not None:
            return
        import fcntl  # POSIX only, like the ipc transport itself

        assert self.runtime_dir is not None
        path = self.runtime_dir / f"{port}.lock"
        f = open(path, "a")  # noqa: SIM115 - held for the sockets' lifetime, closed by release()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OSError(
                    f"another trainer is using port {port} in {self.runtime_dir}; pick another --port"
                ) from None
            raise
        self._lock = f

    def check_free(self, port: int) -> None:
        """OSError if a trainer holds `port` in this runtime directory (ipc only)."""
        if self.kind != "ipc":
            return
        self.claim(port)
        assert self._lock is not None
        self._lock.close()  # nobody held it: let go without touching the files
        self._lock = None

    def release(self) -> None:
        """Trainer side, after closing the sockets: remove the socket files, then the lock."""
        if self._lock is None:
            return
        for path in (self.data, self.control, f"ipc://{self._lock.name}"):
            with contextlib.suppress(OSError):
                os.unlink(path.removeprefix("ipc://"))
        self._lock.close()
        self._lock = None


class HandshakeFailed(RuntimeError):
    """The trainer's ZeroMQ endpoint keeps refusing this producer's connection (keys, mechanism)."""


# -- the runtime directory ------------------------------------------------------------------------------


def _owned_private(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def default_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and _owned_private(Path(xdg)):  # after `su`, it may still name the previous user's directory
        return Path(xdg) / "lmpipe"
    return Path("/tmp") / f"lmpipe-{os.getuid()}"


def private_dir(path: str | Path) -> Path:
    """Create `path` (mode 0700) if needed and check that only this user can use it; ValueError if not."""
    d = Path(path).absolute()
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ValueError(
            f"cannot create the runtime directory {d}: {exc.strerror}; pass --runtime-dir"
        ) from None
    st = os.lstat(d)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    elif st.st_mode & 0o077:
        problem = (
            f"is open to other users (mode {stat.S_IMODE(st.st_mode):o}); `chmod 700 {d}` if that is safe"
        )
    else:
        return d
    raise ValueError(
        f"refusing the runtime directory {d}: it {problem}. Producers and the trainer meet there through "
        "Unix sockets that only its owner may reach; remove it or pass another --runtime-dir"
    )


# -- endpoints ------------------------------------------------------------------------------------------


def endpoints(cfg: PipelineConfig) -> Endpoints:
    """The addresses both sides use for `cfg`; for ipc, the runtime directory is created and checked."""
    if cfg.curve_dir or cfg.trusted_network or not is_loopback(cfg.host):
        kind = "curve" if cfg.curve_dir else "trusted"
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        return Endpoints(
            f"tcp://{host}:{cfg.port}", f"tcp://{host}:{cfg.port + 1}", kind, curve_dir=cfg.curve_dir
        )
    if not hasattr(os, "getuid"):  # no Unix sockets with owner checks (Windows)
        raise ValueError("this platform has no private Unix sockets: pass --curve-dir or --trusted-network")
    d = private_dir(cfg.runtime_dir) if cfg.runtime_dir else private_dir(default_runtime_dir())
    data, control = d / f"{cfg.port}.data", d / f"{cfg.port}.ctl"
    if len(str(control).encode()) > UNIX_PATH_MAX:
        raise ValueError(
            f"{control} is too long for a Unix socket ({UNIX_PATH_MAX} bytes at most); pass a shorter --runtime-dir"
        )
    return Endpoints(f"ipc://{data}", f"ipc://{control}", "ipc", runtime_dir=d)


# -- sockets --------------------------------------------------------------------------------------------


def open_socket(
    ctx: zmq.Context,
    role: Role,
    cfg: PipelineConfig,
    ep: Endpoints,
    *,
    max_message: int = -1,
    connect: bool = True,
) -> Any:
    """A socket for `role` with every option set, bound (trainer) or connected (producer) to `ep`.
    `max_message` bounds the trainer's data messages (bigger ones cut the connection). With
    connect=False a producer socket is left unconnected, so a monitor can be attached first: a handshake
    that fails before its monitor exists is never reported, and libzmq does not retry a refused one."""
    s = ctx.socket(role.type)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        if role is TRAINER_DATA:
            s.setsockopt(zmq.RCVHWM, RECV_HWM)
            s.setsockopt(zmq.RCVBUF, max(1 << 16, 2 * batch_bytes(cfg)))
            s.setsockopt(zmq.MAXMSGSIZE, max_message)
        elif role is PRODUCER_DATA:
            s.setsockopt(zmq.SNDHWM, SEND_HWM)
            # ZeroMQ's HWM counts messages in its own queues; the kernel's socket buffer holds more on top.
            # Keep that to a couple of batches too, so backpressure reaches the tokenizer quickly.
            s.setsockopt(zmq.SNDBUF, max(1 << 16, 2 * batch_bytes(cfg)))
        else:  # control
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            s.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
            s.setsockopt(zmq.RCVHWM, CONTROL_HWM)
        if role is TRAINER_CONTROL:  # a producer that reconnects keeps its routing id (below)
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if role is PRODUCER_CONTROL:  # a routing id of its own: the trainer knows it again after a reconnect
            s.setsockopt(zmq.ROUTING_ID, b"lmpipe-" + os.urandom(8))
        if not role.bind:
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue only to live, authenticated connections
            s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        if ep.kind == "curve":
            assert ep.curve_dir
            (server_sockets if role.bind else client_sockets)([s], ep.curve_dir)
        addr = ep.data if role.data else ep.control
        if role.bind:
            try:
                s.bind(addr)
            except zmq.ZMQError as exc:
                raise OSError(f"cannot listen on {addr}: {exc}") from None
        elif connect:
            s.connect(addr)
    except BaseException:
        s.close(0)
        raise
    return s


# -- a producer's view of its handshakes ----------------------------------------------------------------

HANDSHAKE_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class HandshakeWatch:
    """Reads a producer socket's monitor events: a trainer endpoint that keeps refusing this producer's
    credentials is a configuration error, reported in one line, instead of a producer "waiting for the
    trainer" forever. A refusal of its key (AUTH) or a mechanism mismatch (PROTOCOL) is final: libzmq does
    not even reconnect. But the peer that notices a mismatch first closes the connection, so this side may
    see only a broken pipe (NO_DETAIL), and then reconnects: after MAX_HANDSHAKE_FAILURES of those in a
    row, with no success in between, the producer gives up too."""

    def __init__(self, ep: Endpoints):
        self.ep = ep
        self.failures = 0
        self.telling: tuple[int, int] | None = None  # (event, value) of an AUTH or PROTOCOL failure
        self.connected_at: float | None = None  # first TCP/IPC connection since the last handshake

    def stalled(self, now: float) -> None:
        """Raise HandshakeFailed when connections were made but none completed its handshake for three
        handshake timeouts: whatever the events said (a refusal's went unseen about once in 60 test
        runs), a producer must not wait forever on a trainer that will never accept it."""
        if self.connected_at is not None and now - self.connected_at > 3 * HANDSHAKE_MS / 1000:
            raise HandshakeFailed(self.explain(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0))

    def __call__(self, event: Mapping[str, Any]) -> bool:
        """Returns True when a handshake succeeded; raises HandshakeFailed when it is time to give up."""
        kind, value = event["event"], int(event["value"])
        log.debug("control connection: %s (%d)", getattr(kind, "name", kind), value)
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failures, self.telling, self.connected_at = 0, None, None
            return True
        if kind == zmq.EVENT_CONNECTED:
            if self.connected_at is None:
                self.connected_at = time.monotonic()
            return False
        if kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            if self.telling is None or kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.telling = (kind, value)
        elif kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return False
        self.failures += 1
        # libzmq does not reconnect after a refusal or a mechanism mismatch: nothing to wait for
        if self.telling or self.failures >= MAX_HANDSHAKE_FAILURES:
            raise HandshakeFailed(self.explain(*(self.telling or (kind, value))))
        return False

    def explain(self, kind: int, value: int) -> str:
        where, keys = self.ep.control, self.ep.curve_dir
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if value == 400 and keys:
                return (
                    f"the trainer at {where} does not accept this producer's CURVE key: add "
                    f"{keys}/client.key to the trainer's authorized/ folder, or use the keys it authorizes"
                )
            return f"the trainer at {where} refused this producer's credentials (ZAP status {value})"
        if (
            kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            if keys:
                return (
                    f"the trainer at {where} does not use CURVE keys; start both sides with the same "
                    "--curve-dir, or neither"
                )
            return (
                f"the trainer at {where} requires CURVE keys: pass --curve-dir with this producer's keys "
                "(client.key_secret and the trainer's server.key, made by `lmpipe keys`)"
            )
        if keys:
            return (
                f"the CURVE handshake with {where} failed {self.failures} times: does {keys}/server.key hold "
                "that trainer's public key?"
            )
        return (
            f"the trainer at {where} closed this producer's connection during the ZeroMQ handshake "
            f"{self.failures} times: it most likely requires CURVE keys (pass --curve-dir with this "
            "producer's keys), or what listens there is not an lmpipe trainer"
        )
