"""A real S3-compatible server on loopback for the tests: moto's, its objects loaded from a folder first.

    python -m tests.s3server --port P --root DIR

Every top-level folder of DIR is a bucket and the files below it are its objects. They are loaded before
the socket opens, so the same command after a kill serves the same objects from its first request: a
restart loses connections and requests in flight, nothing else (moto keeps objects in memory only).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO, free_ports


class S3Server:
    """tests/s3server.py in its own process: a real HTTP server that a test can kill -9 and restart."""

    def __init__(self, root: Path, log: Path):
        self.root, self.log = root, log
        self.port = free_ports(2)
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> None:
        before = self.starts
        out = open(self.log, "ab")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.s3server", "--port", str(self.port), "--root", str(self.root)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while self.starts == before:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-2000:]
            time.sleep(0.05)

    @property
    def starts(self) -> int:
        return self.log.read_text(errors="replace").count("s3 server ready") if self.log.exists() else 0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    root = Path(args.root)
    for bucket in sorted(q for q in root.iterdir() if q.is_dir()):
        backend.create_bucket(bucket.name, "us-east-1")
        for f in sorted(q for q in bucket.rglob("*") if q.is_file()):
            backend.put_object(bucket.name, f.relative_to(bucket).as_posix(), f.read_bytes())
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    print(f"s3 server ready on 127.0.0.1:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.pause()


if __name__ == "__main__":
    main()
