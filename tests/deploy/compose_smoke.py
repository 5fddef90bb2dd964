"""docker-compose.yml in real containers: build the images, bring the stack up with the engine found (Docker
Compose v2, or podman with podman-compose), check it, tear it down. Run by deploy/compose-smoke.sh (CI: .ci/run).

1. Two producers (the compose default) and the CPU trainer: training steps; the compose Prometheus finds every
   producer replica by DNS and every Grafana dashboard query returns data from it; the health checks pass.
2. `up --scale producer=3`: compose adds a replica to the running stack (the trainer is not recreated and
   gives it shards): the same checks.
3. `up` again with changed settings and without --scale: the trainer is recreated with them and the producers
   go back to 2 (podman-compose 1.6 alone keeps the old trainer here: deploy/podman/compose.sh). A finite
   epoch with a document log: the trainer's main process is killed (SIGKILL, as the OOM killer does). Its
   restart policy brings the container back, it resumes from its latest checkpoint in the shared volume, the
   producers rejoin, and the epoch ends with every token of every document trained exactly once.
4. `down` asking for fewer replicas than are up: no container of the project is left.

Grafana is not started: its image cannot be pulled or installed on this project's machines; its
provisioning and dashboard are checked statically (tests/unit/deploy/test_grafana.py).

Exit status: 0 passed, 1 a check failed, 77 skipped (no container engine can run containers here: the reason
is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.compose import load_compose
from tests.deploy.dashboard import GRAFANA_VARS, dashboard_exprs, empty_allowed, expand, nan_allowed
from tests.deploy.shipped import COMPOSE, debian_image
from tests.helpers import REPO

SKIPPED = 77
PROJECT = "lmpipe-smoke"
DEBIAN_IMAGE = debian_image()  # what deploy/debian/base.sh builds
PROMETHEUS = "http://127.0.0.1:9090"  # the port docker-compose.yml publishes on loopback
# Grafana's $__rate_interval for the compose Prometheus's 5 s scrape interval (4 scrapes)
RATE_INTERVAL = "20s"
SERVICES = ["trainer", "producer", "prometheus"]  # not Grafana (see above)
MIN_PODMAN_COMPOSE = (1, 6)  # 1.0.x ignores scale, breaks CMD health checks and ${VAR:-}, cannot read !reset


class Skip(Exception):
    """No container engine can run the stack here."""


class Failed(Exception):
    """A check failed."""


def say(msg: str) -> None:
    print(f"compose-smoke: {msg}", flush=True)


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True, **kw)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def version_tuple(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


# -- the engine ------------------------------------------------------------------------------------------


@dataclass
class Engine:
    name: str  # docker | podman
    compose: list[str]  # the compose command and its global options, before -p/-f
    env: dict[str, str] = field(default_factory=dict)  # added to every command's environment
    build_options: list[str] = field(default_factory=list)  # compose options for `build`

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # The caller's LMPIPE_* must not leak into the stack: each phase sets what it needs.
        base = {k: v for k, v in os.environ.items() if not k.startswith("LMPIPE_")}
        return {**base, **self.env, **(extra or {})}

    def cli(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = run([self.name, *args], env=self.environ(), timeout=timeout)
        if check and r.returncode != 0:
            raise Failed(f"`{self.name} {' '.join(args)}` failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        return r


def find_docker() -> Engine | str:
    if shutil.which("docker") is None:
        return "docker: not installed"
    r = run(["docker", "compose", "version", "--short"])
    if r.returncode != 0:
        return "docker: no Compose v2 (`docker compose`)"
    if version_tuple(r.stdout) < (2, 24):
        return f"docker: Compose {r.stdout.strip()} is older than 2.24 (docker-compose.cpu.yml uses !reset)"
    r = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30)
    if r.returncode != 0:
        return f"docker: no engine answers ({last_line(r.stderr)})"
    return Engine("docker", ["docker", "compose"])


def find_podman() -> Engine | str:
    if shutil.which("podman") is None:
        return "podman: not installed"
    pc = shutil.which("podman-compose")
    if pc is None:
        return "podman: podman-compose is not installed (pip install 'podman-compose>=1.6'; the dev extra has it)"
    r = run([pc, "version"])
    have = version_tuple(
        r.stdout.split("podman-compose", 1)[-1] if "podman-compose" in r.stdout else r.stdout
    )
    if have < MIN_PODMAN_COMPOSE:
        raise Failed(
            f"{pc} is version {'.'.join(map(str, have)) or '?'}: it ignores `scale`, breaks CMD health checks "
            "and ${VAR:-} defaults, and cannot read docker-compose.cpu.yml (!reset). "
            "Put podman-compose >= 1.6 first in PATH (pip install 'podman-compose>=1.6'; the dev extra has it)"
        )
    r = run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], timeout=60)
    if r.returncode != 0:
        return f"podman: `podman info` fails ({last_line(r.stderr)})"
    # deploy/podman/compose.sh: podman-compose with `--in-pod false` (each replica in its own network
    # namespace, as with Docker Compose), and up/down that act on every replica, as Docker Compose does
    return Engine("podman", [str(REPO / "deploy" / "podman" / "compose.sh")], env={"PODMAN_COMPOSE": pc})


def find_engine(choice: str) -> Engine:
    reasons = []
    for name, finder in (("docker", find_docker), ("podman", find_podman)):
        if choice in ("auto", name):
            found = finder()
            if isinstance(found, Engine):
                return found
            reasons.append(found)
    raise Skip("; ".join(reasons))


def probe_containers(engine: Engine, image: str) -> None:
    """Run one container. Where podman's defaults cannot (crun on cgroups v1 hybrid, ulimits above the host's
    hard limits), try again with deploy/podman/containers.conf and keep it if that works."""
    cmd = ["run", "--rm", "--network", "none", "--entrypoint", "true", image]
    r = run([engine.name, *cmd], env=engine.environ(), timeout=120)
    if r.returncode == 0:
        return
    reason = last_line(r.stderr)
    conf = REPO / "deploy" / "podman" / "containers.conf"
    if engine.name == "podman" and "CONTAINERS_CONF" not in os.environ:
        r = run([engine.name, *cmd], env=engine.environ({"CONTAINERS_CONF": str(conf)}), timeout=120)
        if r.returncode == 0:
            engine.env["CONTAINERS_CONF"] = str(conf)
            say(f"podman's defaults cannot run a container here ({reason}); using {conf.relative_to(REPO)}")
            return
        reason = f"{reason}; with {conf.relative_to(REPO)}: {last_line(r.stderr)}"
    raise Skip(f"{engine.name} cannot run a container here: {reason}")


# -- images ----------------------------------------------------------------------------------------------


def pip_mounts(work: Path) -> list[str]:
    """podman build options that give pip in the build the host's settings: its CA bundle (a TLS-inspecting
    proxy's certificate) and its find-links folders (the CPU torch wheel), read-only. Docker's build has no
    bind mounts: there pip uses the image's own settings."""
    r = run([sys.executable, "-m", "pip", "config", "list"])
    conf: dict[str, str] = {}
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        conf[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    cert = os.environ.get("PIP_CERT") or conf.get("cert")
    links = (os.environ.get("PIP_FIND_LINKS") or conf.get("find-links") or "").split()
    links = [d for d in links if Path(d).is_dir()]
    lines, opts = ["[global]"], []
    if cert and Path(cert).is_file():
        lines.append("cert = /etc/lmpipe-host-ca.crt")
        opts += ["-v", f"{cert}:/etc/lmpipe-host-ca.crt:ro"]
    if links:
        lines.append("find-links = " + " ".join(links))
        for d in links:
            opts += ["-v", f"{d}:{d}:ro"]
    pip_conf = work / "pip.conf"
    pip_conf.write_text("\n".join(lines) + "\n")
    return ["-v", f"{pip_conf}:/etc/pip.conf:ro", *opts]


def choose_base(engine: Engine, choice: str, rebuild: bool) -> str:
    """public: the Dockerfiles' default base images; debian: the local Debian base (deploy/debian/base.sh)."""
    if choice == "auto":
        # the producer's default base; the trainer's CPU base and Prometheus come from the same registry
        r = engine.cli("pull", "python:3.12.11-slim-bookworm", timeout=600, check=False)
        if r.returncode == 0:
            choice = "public"
        else:
            choice = "debian"
            say(f"no image registry answers ({last_line(r.stderr)}): building on a Debian base instead")
    if choice == "debian":
        have = engine.cli("image", "inspect", DEBIAN_IMAGE, check=False).returncode == 0
        if rebuild or not have:
            t0 = time.monotonic()
            r = run(
                [str(REPO / "deploy" / "debian" / "base.sh"), engine.name], env=engine.environ(), timeout=1200
            )
            if r.returncode != 0:
                raise Failed(f"deploy/debian/base.sh failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
            say(f"{DEBIAN_IMAGE} built from Debian's archive in {time.monotonic() - t0:.0f} s")
        else:
            say(f"{DEBIAN_IMAGE} is there already (--rebuild-base builds it anew)")
    return choice


# -- the stack -------------------------------------------------------------------------------------------


class Stack:
    def __init__(self, engine: Engine, base: str, work: Path):
        self.engine, self.base, self.work = engine, base, work
        self.files = ["docker-compose.yml", "docker-compose.cpu.yml"]
        if base == "debian":
            self.files.append("docker-compose.debian.yml")
        self.override = work / "smoke.yml"
        self.phase_env: dict[str, str] = {}
        self.log = open(work / "compose.log", "a")  # noqa: SIM115 - closed in main()

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in [*self.files, str(self.override)] for a in ("-f", f)]
        opts = self.engine.build_options if args and args[0] == "build" else []
        cmd = [*self.engine.compose, *opts, "-p", PROJECT, *files, *args]
        shown = " ".join(shlex.quote(c) for c in cmd)
        say(f"$ {shown}")
        self.log.write(f"\n$ {shown}\n")
        self.log.flush()
        r = subprocess.run(
            cmd,
            cwd=REPO,
            env=self.engine.environ(self.phase_env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise Failed(f"compose {args[0]} failed (exit {r.returncode}); see {self.work / 'compose.log'}")
        return r

    def write_override(self, trainer_flags: list[str], both_env: dict[str, str]) -> None:
        """Settings docker-compose.yml does not pass through, for this phase only: flags added to the
        trainer's command as docker-compose.yml has it, variables for the trainer and the producers."""
        command = load_compose(COMPOSE)["services"]["trainer"]["command"]
        doc = {
            "services": {
                "trainer": {"command": [*command, *trainer_flags], "environment": dict(both_env)},
                "producer": {"environment": dict(both_env)},
            }
        }
        self.override.write_text(json.dumps(doc, indent=1) + "\n")  # JSON is YAML

    def containers(self, service: str | None = None) -> list[str]:
        """The project's containers (of one service), running or not."""
        only = ["--filter", f"label=com.docker.compose.service={service}"] if service else []
        r = self.engine.cli(
            "ps", "-a", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={PROJECT}", *only
        )
        return r.stdout.split()

    def inspect(self, cid: str) -> dict:
        return json.loads(self.engine.cli("inspect", cid).stdout)[0]

    def ip(self, cid: str) -> str:
        nets = self.inspect(cid)["NetworkSettings"]["Networks"]
        (ip,) = [n["IPAddress"] for n in nets.values() if n.get("IPAddress")]
        return ip

    def logs(self, cid: str) -> str:
        r = self.engine.cli("logs", cid, check=False)
        return r.stdout + r.stderr

    def read_data_file(self, cid: str, name: str) -> str:
        """A file of the volume mounted at /data in container `cid`, read through a throwaway container of
        its image (podman 4.3 cannot `cp` out of a stopped container's volume)."""
        info = self.inspect(cid)
        (volume,) = [m["Name"] for m in info["Mounts"] if m["Destination"] == "/data"]
        r = self.engine.cli(
            "run", "--rm", "--no-healthcheck", "--network", "none", "-v", f"{volume}:/data:ro", "--entrypoint", "cat",
            info["Image"], f"/data/{name}",
        )  # fmt: skip
        return r.stdout

    def trainer(self) -> str:
        (cid,) = self.containers("trainer")
        return cid

    def dump_logs(self) -> None:
        """Every container's log into the work folder; the last lines of each on stderr."""
        for service in SERVICES:
            for cid in self.containers(service):
                text = self.logs(cid)
                path = self.work / f"{service}-{cid[:12]}.log"
                path.write_text(text)
                tail = "\n".join(text.splitlines()[-25:])
                print(f"----- {service} {cid[:12]}: last 25 lines of {path}\n{tail}", file=sys.stderr)


def wait_for(what: str, probe: Callable[[], str | None], timeout: float, every: float = 1.0) -> None:
    """Poll until probe() returns None (done); it returns what is still missing, for the failure message."""
    deadline = time.monotonic() + timeout
    missing = "not checked yet"
    while time.monotonic() < deadline:
        try:
            got = probe()
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as exc:
            got = f"{type(exc).__name__}: {exc}"
        if got is None:
            return
        missing = got
        time.sleep(every)
    raise Failed(f"{what}: still not so after {timeout:.0f} s: {missing}")


def prom(path: str, **params: str) -> dict:
    url = f"{PROMETHEUS}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise Failed(f"Prometheus {path} {params}: {body}")
    return body["data"]


def query(expr: str) -> list[dict]:
    return prom("/api/v1/query", query=expr)["result"]


def port_9090_is_free() -> None:
    """docker-compose.yml publishes Prometheus on 127.0.0.1:9090; something else there would answer instead."""
    with socket.socket() as s:
        s.settimeout(2)
        if s.connect_ex(("127.0.0.1", 9090)) == 0:
            raise Failed(
                "127.0.0.1:9090 is taken (docker-compose.yml publishes Prometheus there): stop what listens "
                "there (Debian's prometheus service?) and run again"
            )


def check_serving(stack: Stack, producers: int, timeout: float) -> None:
    """Training steps; the compose Prometheus scrapes the trainer and finds every producer replica by DNS;
    every dashboard query returns finite data; the trainer sees every producer; the health checks pass."""
    cids = stack.containers("producer")
    if len(cids) != producers:
        raise Failed(f"{len(cids)} producer containers, expected {producers}")
    want = {f"{stack.ip(c)}:9401" for c in cids}

    def targets() -> str | None:
        active = prom("/api/v1/targets", state="active")["activeTargets"]
        got = {t["labels"]["instance"]: t["health"] for t in active if t["labels"]["job"] == "producer"}
        trainer = [t["health"] for t in active if t["labels"]["job"] == "trainer"]
        if set(got) != want or set(got.values()) != {"up"} or trainer != ["up"]:
            return f"producer targets {got} (replicas at {sorted(want)}), trainer {trainer}"
        return None

    wait_for(f"Prometheus finds the {producers} producer replicas by DNS", targets, timeout)
    say(
        f"Prometheus scrapes the trainer and the {producers} producer replicas it found by DNS: {sorted(want)}"
    )

    exprs = dashboard_exprs()

    def dashboard() -> str | None:
        steps = query("sum(lmpipe_trainer_steps_total)")
        if not steps or float(steps[0]["value"][1]) < 10:  # two logging intervals (--log-every 5)
            return f"trainer steps scraped: {steps[0]['value'][1] if steps else 'none'}"
        bad = {}
        for expr in exprs:
            res = query(expand(expr, {**GRAFANA_VARS, "$__rate_interval": RATE_INTERVAL}))
            values = [float(r["value"][1]) for r in res]
            if (not res and not empty_allowed(expr)) or not (
                all(math.isfinite(v) for v in values) or nan_allowed(expr)
            ):
                bad[expr] = values or "no data"
        connected = query("max(lmpipe_trainer_producers_connected)")
        if not connected or float(connected[0]["value"][1]) != producers:
            bad["max(lmpipe_trainer_producers_connected)"] = connected
        return json.dumps(bad, indent=1) if bad else None

    wait_for("every dashboard query returns data", dashboard, timeout, every=2.0)
    say(f"all {len(exprs)} dashboard queries return data; the trainer counts {producers} producers connected")
    rules = {r["name"]: r["health"] for g in prom("/api/v1/rules")["groups"] for r in g["rules"]}
    if len(rules) < 7 or set(rules.values()) != {"ok"}:
        raise Failed(f"the alert rules are not all loaded and healthy: {rules}")
    say(f"Prometheus evaluates the {len(rules)} alert rules of deploy/prometheus/lmpipe.rules.yml")
    check_health(stack)


def check_health(stack: Stack) -> None:
    cids = [c for s in SERVICES for c in stack.containers(s)]
    if stack.engine.name == "podman":
        # podman runs health checks from systemd timers; without systemd they run on request: compose.sh
        # health runs each container's once (exit 1 if one fails), after which podman reports them healthy
        stack.compose("health")
        states = {c[:12]: stack.inspect(c)["State"].get("Health", {}).get("Status") for c in cids}
        if set(states.values()) != {"healthy"}:
            raise Failed(f"after `compose.sh health`, podman reports {states}")
    else:

        def healthy() -> str | None:
            states = {c[:12]: stack.inspect(c)["State"].get("Health", {}).get("Status") for c in cids}
            return None if set(states.values()) == {"healthy"} else str(states)

        wait_for("every container is healthy", healthy, 120)
    say(f"health checks pass ({len(cids)} containers)")


def check_recreated(stack: Stack, old: str, setting: str, producers: int) -> None:
    """`up` with a changed setting recreated the trainer with it, and replicas beyond the number asked for
    are gone (podman-compose alone keeps the old trainer and the replicas: deploy/podman/compose.sh)."""
    cid = stack.trainer()
    env = stack.inspect(cid)["Config"]["Env"]
    if cid == old or setting not in env:
        raise Failed(f"`up` with {setting} did not recreate the trainer with it (container {cid[:12]})")
    got = len(stack.containers("producer"))
    if got != producers:
        raise Failed(f"{got} producer containers after `up` without --scale, expected {producers}")
    say(f"`up` with {setting} recreated the trainer with it, and scaled the producers back to {producers}")


def kill_trainer_process(stack: Stack) -> int:
    """SIGKILL the trainer's main process from outside, as the OOM killer would: not `stop`/`kill` through
    the engine, which mark the container as stopped by the user (no restart, by design)."""
    state = stack.inspect(stack.trainer())["State"]
    pid = int(state["Pid"])
    if pid <= 0:
        raise Failed(f"the trainer container is not running: {state}")
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError:
        raise Failed(f"not allowed to kill the trainer's process {pid}: run as root") from None
    except ProcessLookupError:
        raise Failed(f"the trainer's process {pid} is not visible from here (a remote engine?)") from None
    return pid


def check_restart_and_exactly_once(stack: Stack, docs: int, timeout: float) -> None:
    """Kill the trainer mid-epoch; it must come back, resume from its checkpoint and finish the epoch with
    every token of every document trained once (the steps after the last checkpoint are trained again)."""
    from lmpipe.shared.tokenizer import load_tokenizer
    from tests.helpers import assert_exactly_once, builtin_lengths, doc_log_entries, trained_pieces

    cid = stack.trainer()
    wait_for(
        "the trainer writes its first checkpoint",
        lambda: (
            None if re.search(r"checkpoint \S+ written", stack.logs(cid)) else "no checkpoint written yet"
        ),
        timeout,
        every=0.3,
    )
    if "summary:" in stack.logs(cid):
        raise Failed(f"the epoch ended before the trainer could be killed: raise --docs (now {docs})")
    pid = kill_trainer_process(stack)
    say(f"killed the trainer's process ({pid}) with SIGKILL after its first checkpoint")

    def restarted() -> str | None:
        info = stack.inspect(cid)
        text = stack.logs(cid)
        if info["RestartCount"] < 1 or "resumed from" not in text:
            return f"restarts {info['RestartCount']}, state {info['State']['Status']}, 'resumed from' not logged yet"
        return None

    wait_for("the restart policy brings the trainer back, resumed from its checkpoint", restarted, timeout)
    text = stack.logs(cid)
    resumed = re.search(r"resumed from (\S+): step (\d+)", text)
    assert resumed is not None
    step = int(resumed.group(2))
    say(f"the trainer came back by itself and resumed from {resumed.group(1)} (step {step})")

    def finished() -> str | None:
        state = stack.inspect(cid)["State"]
        return None if state["Status"] == "exited" else f"state {state['Status']}"

    wait_for("the resumed trainer finishes the epoch", finished, timeout)
    time.sleep(3)  # a restart policy that restarted a clean exit would show by now
    info = stack.inspect(cid)
    text = stack.logs(cid)
    if info["State"]["Status"] != "exited" or info["State"]["ExitCode"] != 0 or info["RestartCount"] != 1:
        raise Failed(
            f"after the epoch: state {info['State']}, restarts {info['RestartCount']} (expected exit 0, 1 restart)"
        )
    if "(end of data)" not in text:
        raise Failed("the resumed trainer did not end with the end of the data:\n" + text[-2000:])
    # the session id is no longer logged (it is a capability): the restarted trainer's own log names the
    # producers that joined it
    after = text[text.rindex("resumed from") :]
    joined = len(re.findall(r"producer (?:#)?\d+(?: #\d+)? joined from", after))  # `producer #K` unnumbered
    expected = len(stack.containers("producer"))
    if joined != expected:
        raise Failed(f"the restarted trainer saw {joined} producers join, expected {expected}")
    say("every producer joined the restarted trainer; it finished the epoch (exit 0) and stayed down")

    local = stack.work / "docs.jsonl"
    local.write_text(stack.read_data_file(cid, "smoke-docs.jsonl"))
    entries = doc_log_entries(local)
    sessions = list(dict.fromkeys(b["session"] for e in entries for b in e["batches"]))
    if len(sessions) != 2:
        raise Failed(f"expected the killed and the resumed session in the document log, found {sessions}")
    last = max(e["step"] for e in entries)
    if last <= step:
        raise Failed(f"the resumed trainer did not step past {step} (last logged step {last})")
    try:
        assert_exactly_once(
            trained_pieces(entries, sessions[0], step), builtin_lengths(load_tokenizer(), docs)
        )
    except AssertionError as exc:
        raise Failed(f"exactly-once broken across the restart: {exc}") from None
    say(f"exactly once: {docs} documents, steps 1..{last}, every token trained once across the restart")


# -- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/compose-smoke.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["auto", "docker", "podman"], default="auto")
    ap.add_argument(
        "--base",
        choices=["auto", "public", "debian"],
        default="auto",
        help="base images: the Dockerfiles' defaults (public), or a Debian base built here from Debian's "
        "archive (debian); auto: debian where no image registry answers",
    )
    ap.add_argument("--rebuild-base", action="store_true", help="build the Debian base image anew")
    ap.add_argument("--docs", type=int, default=600, help="built-in documents in the killed epoch (phase 3)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds each wait may take")
    ap.add_argument(
        "--keep", action="store_true", help="leave the stack up at the end (the next run tears it down first)"
    )
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    timings: dict[str, float] = {}
    try:
        engine = find_engine(args.engine)
    except Skip as exc:
        say(f"SKIPPED: no container engine can run the stack here: {exc}")
        return SKIPPED
    except Failed as exc:
        say(f"FAILED: {exc}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="lmpipe-smoke."))
    say(f"engine: {engine.name} ({' '.join(engine.compose)}); logs in {work}")
    stack: Stack | None = None
    torn_down = False
    try:
        t0 = time.monotonic()
        base = choose_base(engine, args.base, args.rebuild_base)
        probe_containers(engine, DEBIAN_IMAGE if base == "debian" else "python:3.12.11-slim-bookworm")
        if engine.name == "podman":
            # keep HEALTHCHECK in the images (the OCI format drops it), and pip's host settings for the build
            build_args = ["--format", "docker", *pip_mounts(work)]
            engine.build_options = ["--podman-build-args=" + shlex.join(build_args)]
        stack = Stack(engine, base, work)
        stack.write_override([], {})
        stack.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)  # a previous run's leftovers
        port_9090_is_free()
        # one after the other: producer and trainer share their layers (tests/unit/deploy/test_dockerfiles.py)
        stack.compose("build", "trainer")
        stack.compose("build", "producer", "prometheus")
        timings["base and images"] = time.monotonic() - t0
        say(f"images built in {timings['base and images']:.0f} s")
        say("Grafana: not started (no image of it can be pulled or installed here); its provisioning and "
            "dashboard are checked statically by tests/unit/deploy/test_grafana.py")  # fmt: skip

        stack.phase_env = {"LMPIPE_CHECKPOINT_EVERY": "5"}  # the checkpoint panel's queries need one
        stack.write_override(["--log-every", "5"], {})
        trainer = ""
        for producers, scale in ((2, []), (3, ["--scale", "producer=3"])):
            t0 = time.monotonic()
            say(f"phase: {producers} producers, the CPU trainer, Prometheus")
            stack.compose("up", "-d", "--no-build", *scale, *SERVICES)
            if trainer and stack.trainer() != trainer:
                raise Failed("`up --scale producer=3` with the settings unchanged recreated the trainer")
            trainer = stack.trainer()
            check_serving(stack, producers, args.timeout)
            timings[f"{producers} producers"] = time.monotonic() - t0

        t0 = time.monotonic()
        stack.phase_env = {
            "LMPIPE_EPOCHS": "1",
            "LMPIPE_SEQ_LEN": "64",
            "LMPIPE_BATCH_SIZE": "8",
            "LMPIPE_CHECKPOINT_DIR": "/data/checkpoints-once",
            "LMPIPE_CHECKPOINT_EVERY": "5",
            "LMPIPE_METRICS_LINGER": "1",
        }
        stack.write_override(
            ["--doc-log", "/data/smoke-docs.jsonl", "--log-every", "5"],
            {"LMPIPE_BUILTIN_DOCS": str(args.docs)},
        )
        say(f"phase: one epoch of {args.docs} documents, the trainer killed after its first checkpoint")
        # `up` again with changed settings and without --scale, after `--scale producer=3`
        stack.compose("up", "-d", "--no-build", *SERVICES)
        check_recreated(stack, trainer, "LMPIPE_EPOCHS=1", producers=2)
        check_restart_and_exactly_once(stack, args.docs, args.timeout)
        timings["kill and resume"] = time.monotonic() - t0

        if not args.keep:
            t0 = time.monotonic()
            # fewer replicas asked for than are up, as by a plain `down` after `up --scale producer=3`
            stack.phase_env = {**stack.phase_env, "LMPIPE_PRODUCERS": "1"}
            stack.compose("down", "-v", "-t", "5")
            if left := stack.containers():
                raise Failed(f"`down` left {len(left)} containers of the project behind")
            torn_down = True
            say("`down` removed every container of the project")
            timings["teardown"] = time.monotonic() - t0
    except Skip as exc:
        say(f"SKIPPED: {exc}")
        return SKIPPED
    except (Failed, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        if stack is not None:
            stack.dump_logs()
        return 1
    finally:
        if stack is not None:
            if args.keep:
                say(f"--keep: the stack stays up (project {PROJECT})")
            elif not torn_down:
                stack.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)
            stack.log.close()
    total = time.monotonic() - t_start
    say("PASSED in " + f"{total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ")")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
