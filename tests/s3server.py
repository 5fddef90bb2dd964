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
import sys
from pathlib import Path


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
