"""A test bed of simulated hosts: network namespaces joined by a switch, with links that can be cut or slowed.

Topology: a "switch" namespace holds a Linux bridge; each host is a namespace of its own with one veth
`eth0` (address 10.213.0.(10+i)/24) whose other end is port `h<i>` of that bridge. Processes started on a
host see only its `lo` and `eth0`: they reach the other hosts' addresses over the bridge and nothing else
(no default route, no link to the machine's own namespace, whose routes and firewall are never touched).
A link is cut by taking its switch port down (a pulled cable: both ends keep their addresses, packets
vanish) and slowed with a token bucket (`tc qdisc ... tbf`) on both of its ends.

Names: every namespace is `lmpnb-<pid>-<random>-<host>`, so parallel runs never collide and the leftovers
of a crashed run (its pid is gone) are removed when the next bed starts. Links are created directly inside
those namespaces (never in the machine's own), so their short names cannot collide either; deleting the
namespaces deletes them. Processes get SIGKILL when the test process dies (PR_SET_PDEATHSIG), and are
killed before the namespaces go, in `close()`, which runs however the `with` block ends.

Needs root and iproute2; `NetBedUnavailable` says why when either is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Procs

PREFIX = "lmpnb-"
SUBNET = "10.213.0"  # exists only inside the bed's namespaces
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


class NetBedUnavailable(RuntimeError):
    """The machine cannot host the bed (not root, no iproute2, namespaces refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(ns: str) -> None:
    """Kill what still runs in `ns` (only ever processes a bed started), then delete it."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of beds whose test process is gone (a crashed or killed run)."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        try:
            pid = int(ns[len(PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def check_available() -> None:
    if os.geteuid() != 0:
        raise NetBedUnavailable("needs root to create network namespaces")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise NetBedUnavailable(f"needs `{tool}` (iproute2 / util-linux)")


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    switch_port: str  # the bridge port its link plugs into


@dataclass
class NetBed:
    """`with NetBed(["trainer", "p0"], tmp) as bed:` builds the bed; leaving the block removes it."""

    names: list[str]
    tmp: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self._made: list[str] = []

    # -- building and removing ----------------------------------------------------------------------

    def __enter__(self) -> NetBed:
        check_available()
        remove_leftovers()
        try:
            self._build()
        except subprocess.CalledProcessError as exc:
            self.close()
            raise NetBedUnavailable(f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}") from None
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns_add(self, ns: str) -> None:
        r = _ip("netns", "add", ns, check=False)
        if r.returncode != 0:
            raise NetBedUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
        self._made.append(ns)

    def _build(self) -> None:
        self._netns_add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = f"{self.tag}-{name}"
            self._netns_add(ns)
            h = Host(name, ns, f"{SUBNET}.{10 + i}", f"h{i}")
            # both ends are born inside their namespaces: nothing appears in the machine's own
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                h.switch_port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.switch, "link", "set", h.switch_port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = h
        # each process also gets a UTS namespace of its own (its host's name): check that works here
        subprocess.run(["ip", "netns", "exec", self.switch, "unshare", "--uts", "true"],
                       capture_output=True, text=True, check=True, timeout=30)  # fmt: skip

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self._made):
            _delete_namespace(ns)
        self._made.clear()

    def namespaces(self) -> list[str]:
        """This bed's namespaces that exist now."""
        return [ns for ns in _namespaces() if ns.startswith(self.tag)]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- processes ----------------------------------------------------------------------------------

    def start(
        self, host: str, *args: str, name: str, env: dict[str, str], module: str = "lmpipe"
    ) -> subprocess.Popen:
        """`python -m lmpipe ARGS` on `host` (`module` for another, e.g. torch.distributed.run), in its own
        UTS namespace so it reports the host's name."""
        h = self.hosts[host]
        log_path = self.tmp / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        cmd = ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
               h.name, sys.executable, "-m", module, *args]  # fmt: skip
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        p.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    # the same log reading and waiting as the local process launcher's
    log = staticmethod(Procs.log)
    wait_for = Procs.wait_for

    def run(self, host: str, *cmd: str) -> str:
        """A short command on `host` (e.g. `ss -tn`); returns its stdout."""
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[host].ns, *cmd],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout

    # -- the network --------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].switch_port, "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].switch_port, "up")

    def limit(self, host: str, kbit: int, queue_kb: int = 16) -> None:
        """Cap the host's link at `kbit` kbit/s each way: a token bucket on both ends of its veth, with a
        queue of `queue_kb` KiB (a queue of a packet or two would make TCP back off far below the rate)."""
        h = self.hosts[host]
        tbf = ["tbf", "rate", f"{kbit}kbit", "burst", "4kb", "limit", f"{queue_kb}kb"]
        for ns, dev in ((h.ns, "eth0"), (self.switch, h.switch_port)):
            r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
            if r.returncode != 0:
                raise NetBedUnavailable(f"`tc qdisc ... tbf` failed: {r.stderr.strip()}")

    def in_netns(self, host: str, fn):
        """Call `fn()` on a thread that has joined `host`'s network namespace: sockets it opens live there."""
        out: dict = {}

        def target() -> None:
            try:
                with open(f"/run/netns/{self.hosts[host].ns}") as f:
                    if _libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns failed")
                out["value"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                out["error"] = exc

        t = threading.Thread(target=target, name=f"netns-{host}")
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def scrape(self, host: str, port: int) -> dict[tuple[str, tuple], float]:
        """Prometheus samples of http://HOST:port/metrics, read from inside the host's namespace:
        {(name, ((label, value), ...)): value}."""
        url = f"http://{self.hosts[host].addr}:{port}/metrics"
        text = self.in_netns(host, lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
