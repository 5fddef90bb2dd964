"""`lmpipe health`: is the lmpipe process at a metrics port on this host making progress?

It reads /metrics on 127.0.0.1, after making sure the port is served by this user: another local user
could bind a port lmpipe wanted first (lmpipe then only warns and trains on) and serve figures of its own
that say "healthy". On Linux the listening socket's owner is in /proc/net/tcp{,6}, and it must be the
user running the check (run it as the user that runs lmpipe, as a container's health check is); elsewhere
it is not checked.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from pathlib import Path

from lmpipe.options import HealthOptions

LISTEN = "0A"  # TCP state in /proc/net/tcp


def listener_uids(port: int) -> set[int] | None:
    """The uids of sockets listening on `port` of this host's loopback or any address; None where the
    kernel does not say (not Linux)."""
    uids: set[int] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(t.exists() for t in tables):
        return None
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 7 and f[3] == LISTEN and int(f[1].rpartition(":")[2], 16) == port:
                uids.add(int(f[7]))
    return uids


def check(opts: HealthOptions) -> int:
    """Print one line; 0 healthy, 1 not."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{opts.metrics_port}/metrics"
    owners = listener_uids(opts.metrics_port)
    me = os.geteuid()
    if owners and me not in owners:
        print(f"unhealthy: port {opts.metrics_port} is served by another user (uid {min(owners)}), not by "
              "this user's lmpipe")  # fmt: skip
        return 1
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            text = r.read().decode()
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    except OSError as exc:
        print(f"unhealthy: {url} does not answer ({exc})")
        return 1
    except ValueError as exc:  # not UTF-8, not Prometheus's text format
        print(f"unhealthy: {url} answers, but not with Prometheus metrics ({exc})")
        return 1
    build = samples.get("lmpipe_build_info")
    if build is None:  # something else holds the port (lmpipe's own server may have failed to bind it)
        print(f"unhealthy: {url} answers, but not as lmpipe (no lmpipe_build_info)")
        return 1
    role = build.labels.get("role", "?")
    if role != "trainer":
        print(f"healthy: lmpipe {role} answers at {url}")
        return 0
    return _trainer(url, {name: s.value for name, s in samples.items()}, opts.stalled_after)


def _trainer(url: str, values: dict[str, float], stalled_after: float) -> int:
    from lmpipe.consumer.report import duration

    needed = ("lmpipe_trainer_last_step_timestamp_seconds", "lmpipe_trainer_global_step")
    if missing := [n for n in needed if n not in values]:
        print(f"unhealthy: {url} answers as an lmpipe trainer, but without {', '.join(missing)}")
        return 1
    step, last = values["lmpipe_trainer_global_step"], values["lmpipe_trainer_last_step_timestamp_seconds"]
    if not math.isfinite(step):
        print(f"unhealthy: trainer at {url} reports step {step}")
        return 1
    started = values.get("process_start_time_seconds", math.nan)
    since, what = (
        (last, "its latest step") if math.isfinite(last) else (started, "its start, with no step since")
    )
    if not math.isfinite(since):
        print(f"unhealthy: trainer at step {int(step)}, with no time of its latest step or its start")
        return 1
    age = time.time() - since
    if age > stalled_after:
        print(f"unhealthy: trainer at step {int(step)}, {duration(age)} since {what} "
              f"(--stalled-after {stalled_after:g})")  # fmt: skip
        return 1
    print(f"healthy: trainer at step {int(step)}, {duration(age)} since {what}")
    return 0
