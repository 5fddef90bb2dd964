"""A real Slurm cluster for tests, made of the network namespaces of tests/netbed.py.

One host `ctl` runs slurmctld; every other host runs a slurmd with its own NodeName and address on the bed's
switch. One munged with a key and socket of its own (in the bed's folder) serves them all: namespaces share
the file system, so every daemon and client reaches it through `AuthInfo=socket=...`. Nothing of the
machine's own Slurm or munge (if any) is read or touched: the daemons and clients get `-f` / `SLURM_CONF` for
the bed's slurm.conf, and every state, spool, pid and log file lives in the bed's folder.

`ProctrackType=proctrack/linuxproc` and `TaskPlugin=task/none` need no cgroups; the daemons run as root,
so jobs run as root. Needs root, iproute2, and Debian's `slurm-wlm` and `munge`: `SlurmUnavailable` says
which is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.netbed import NetBed, NetBedUnavailable, _die_with_parent

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue")


class SlurmUnavailable(RuntimeError):
    """The machine cannot run the test cluster (no Slurm or munge, not root, no namespaces)."""


def check_available() -> None:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        raise SlurmUnavailable(
            f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
        )


def _conf(dir: Path, bed: NetBed, partitions: dict[str, list[str]], cpus: int) -> str:
    ctl = bed["ctl"]
    lines = [
        "ClusterName=lmpipetest",
        f"SlurmctldHost=ctl({ctl.addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={dir / 'munge.sock'},cred_expire=5",
        f"StateSaveLocation={dir / 'state'}",
        f"SlurmdSpoolDir={dir / 'spool'}/%n",
        f"SlurmctldPidFile={dir / 'slurmctld.pid'}",
        f"SlurmdPidFile={dir / 'spool'}/slurmd-%n.pid",
        f"SlurmctldLogFile={dir / 'slurmctld.log'}",
        f"SlurmdLogFile={dir / 'slurmd'}-%n.log",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",  # heterogeneous jobs need it
        "SchedulerParameters=bf_interval=1,sched_interval=1",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=5",
        "MinJobAge=300",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
    ]
    for part, nodes in partitions.items():
        for n in nodes:
            lines.append(f"NodeName={n} NodeAddr={bed[n].addr} CPUs={cpus} State=UNKNOWN")
        lines.append(f"PartitionName={part} Nodes={','.join(nodes)} MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmBed:
    """`with SlurmBed(tmp, {"gpu": ["t0"], "cpu": ["p0", "p1"]}) as cluster:` starts munged, slurmctld on
    host `ctl` and one slurmd per node; leaving the block stops them and removes the namespaces."""

    tmp: Path
    partitions: dict[str, list[str]]
    cpus: int = 2
    bed: NetBed = field(init=False)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir = self.tmp / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.nodes = [n for nodes in self.partitions.values() for n in nodes]

    def __enter__(self) -> SlurmBed:
        check_available()
        self.bed = NetBed(["ctl", *self.nodes], self.tmp)
        try:
            self.bed.__enter__()
        except NetBedUnavailable as exc:
            raise SlurmUnavailable(str(exc)) from None
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**(base if base is not None else os.environ), "SLURM_CONF": str(self.conf)}

    def _spawn(self, host: str, argv: list[str], log: str) -> subprocess.Popen:
        """A daemon on `host`, in a UTS namespace named after the host (slurmctld checks its own name)."""
        h = self.bed[host]
        with open(self.dir / log, "wb") as out:
            p = subprocess.Popen(
                # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs /sys/fs/cgroup. A mount
                # namespace of its own shows the bed's hosts file as /etc/hosts: the cluster's DNS
                [
                    "nsenter",
                    f"--net=/run/netns/{h.ns}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "sh",
                    "-c",
                    'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
                    h.name,
                    str(self.dir / "hosts"),
                    *argv,
                ],  # fmt: skip
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.bed.procs.append(p)  # the bed kills it before the namespaces go
        self.daemons.append(p)
        return p

    def _start(self) -> None:
        for d in ("state", *(f"spool/{n}" for n in self.nodes)):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.dir.chmod(0o755)
        munged = shutil.which("munged") or "/usr/sbin/munged"
        m = subprocess.Popen(
            [
                munged,
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={self.dir / 'munge.sock'}",
                f"--pid-file={self.dir / 'munged.pid'}",
                f"--log-file={self.dir / 'munged.log'}",
                f"--seed-file={self.dir / 'munged.seed'}",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.bed.procs.append(m)
        self.daemons.append(m)
        self.conf.write_text(_conf(self.dir, self.bed, self.partitions, self.cpus))
        hosts = ["127.0.0.1 localhost"] + [f"{h.addr} {h.name}" for h in self.bed.hosts.values()]
        (self.dir / "hosts").write_text("\n".join(hosts) + "\n")
        self._wait(lambda: (self.dir / "munge.sock").exists(), 10, "munged's socket")
        self._spawn("ctl", ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for n in self.nodes:
            self._spawn(n, ["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")
        self._wait(self._all_idle, 30, "every node idle")

    def _all_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return set(states) == set(self.nodes) and all(s == "idle" for s in states.values())

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            for p in self.daemons:
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{p.args[-3:]} exited ({p.returncode}) waiting for {what}:\n"
                                           + self.logs())  # fmt: skip
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    def run(self, *cmd: str, check: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None):
        """A Slurm client command (sbatch, scontrol, squeue...) on the controller's host."""
        r = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.bed['ctl'].ns}", *cmd],
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=cwd,
            timeout=30,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr}\n{self.logs()}")
        return r

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as {field: value} (a heterogeneous job: its first component's)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout.splitlines()[0]
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def close(self) -> None:
        self.bed.close()
