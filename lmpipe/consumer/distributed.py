"""Data parallelism under `torchrun`: one trainer rank per GPU, each with its own receiver and producers.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; rank r binds the trainer's port + 2r (data, control) and is fed
by producers started with `--rank r --world-size R` (which own a disjoint share of the corpus). Gradients
are averaged by DDP over NCCL (gloo on CPU). Host-side agreement, once per step, goes over a separate gloo
group so that it never waits on the GPU: the step's target-token count summed over ranks (the loss is
normalised by it, so R ranks make exactly the update one GPU would make on the union of their batches), and
whether every rank still has data and nobody asked to stop (ranks stop together, or NCCL would hang).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class RankLost(RuntimeError):
    """A rank of the job ended mid-run; the message names it. `exit_code`: the CLI says the message in one
    line and exits with it (not a usage error)."""

    exit_code = 1


def _gone(pid: int) -> bool:
    """The process has ended (a zombie its launcher has not reaped yet counts as ended)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except ProcessLookupError:
        return True
    except OSError:  # no /proc (not Linux), or not ours to signal: alive as far as we can tell
        return False


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host_group: Any = field(default=None, repr=False)  # gloo group for host scalars
    peers: list[tuple[str, int]] = field(default_factory=list)  # every rank's (host name, pid)
    restarts: int = 0  # torchrun's restarts of this host's workers so far (TORCHELASTIC_RESTART_COUNT)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, targets: int, has_data: bool, stopping: bool) -> tuple[int, bool, bool]:
        """(targets summed over ranks, does any rank have data, does any rank want to stop)."""
        if not self.enabled:
            return targets, has_data, stopping
        t = torch.tensor([targets, int(has_data), int(stopping)], dtype=torch.int64)
        dist.all_reduce(t, group=self.host_group)
        return int(t[0]), bool(t[1]), bool(t[2])

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return bool(t[0])

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.host_group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.host_group)

    def lost(self, exc: BaseException, wait: float = 2.0) -> RankLost | None:
        """A collective's failure (gloo: "Connection closed by peer") as the rank that was lost, where a
        rank on this host has ended; None where none has (another failure, or a rank on another host)."""
        if not self.enabled or not isinstance(exc, RuntimeError):
            return None
        here = socket.gethostname()
        # A killed process's sockets close before it turns zombie: the collective can fail while the peer
        # still looks alive, so look again for a moment before calling it another failure.
        deadline = time.monotonic() + wait
        while True:
            gone = [f"rank {r} (pid {pid})" for r, (host, pid) in enumerate(self.peers)
                    if r != self.rank and host == here and _gone(pid)]  # fmt: skip
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if not gone:
            # a rank on another host: its pid cannot be looked at from here, but gloo names the address
            # whose connection closed (a process that ended, or a host lost)
            m = re.search(r"\[([^\]\s]+)\]:\d+", str(exc))  # "[10.0.0.2]:4242"
            others = sorted({h for h, _ in self.peers if h != here})
            if m is None or not others or not re.search(r"Connection (closed|reset) by peer", str(exc)):
                return None
            gone = [f"the rank at {m.group(1)} (hosts {', '.join(others)})"]
        return RankLost(f"{', '.join(gone)} of the torchrun job ended mid-run; rank {self.rank} stops too "
                        "(resume from the last checkpoint)")  # fmt: skip

    def will_restart(self) -> bool:
        """torchrun's agent has restarts left for this host's workers (a lost rank is then resumed)."""
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) - self.restarts
        return self.enabled and left > 0

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


ROUND_KEY = "lmpipe/round-store"  # in torchrun's store: where this round's rank 0 serves the ranks' store


def _reachable_ip(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket's connect only routes)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def round_store(rank: int, timeout: datetime.timedelta) -> Any | None:
    """The store this restart's ranks meet in, where torchrun shares its agent's store with its workers
    (TORCHELASTIC_USE_AGENT_STORE, c10d rendezvous): that store outlives the workers, so after an elastic
    restart it still holds the killed round's keys, and gloo/NCCL read a dead rank's address there and fail
    to connect (torch issue 135712). Rank 0 serves a fresh store and says where in the agent's store; the
    other ranks connect to the address they read there, and read again while it does not answer: only the
    live round's rank 0 answers (the agent stops every worker of a round before the next starts). None:
    no agent store (torch's own rendezvous is fresh each round)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    if rank == 0:
        ip = _reachable_ip(addr, port)
        own = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        # the store listens on every interface; a loopback route means torchrun's store is on this host
        # (whose name may resolve to 127.0.1.1 here): the other hosts reach it by torchrun's own address
        agent.set(ROUND_KEY, f"{addr if ipaddress.ip_address(ip).is_loopback else ip} {own.port}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        ip, _, p = agent.get(ROUND_KEY).decode().partition(" ")
        try:  # a dead round's address: refused until the attempt's timeout
            store = dist.TCPStore(ip, int(p), is_master=False, timeout=datetime.timedelta(seconds=1))
        except (RuntimeError, OSError):  # DistNetworkError / DistStoreError are RuntimeErrors
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        store.set_timeout(timeout)  # gloo's waits for the other ranks' keys: the long one
        return store


def from_env(device: str) -> Dist:
    """The torchrun world this process is part of (a world of one without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if world <= 1:
        return Dist(restarts=restarts)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    # The first step waits for every rank's producers; don't let NCCL's watchdog call that a hang.
    timeout = datetime.timedelta(minutes=30)
    store = round_store(rank, timeout)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=timeout,
        device_id=torch.device("cuda", local_rank) if cuda else None,
        **({"store": store, "rank": rank, "world_size": world} if store is not None else {}),
    )
    host = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    peers: list[Any] = [None] * world  # so that a lost rank can be named (Dist.lost)
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=host)
    return Dist(rank, world, local_rank, host, [(str(h), int(p)) for h, p in peers], restarts)
