"""Logging setup shared by every process: one line per event on stderr, prefixed with the role."""

from __future__ import annotations

import logging
import os
import sys


def setup(role: str, level: str | None = None) -> logging.Logger:
    """Configure the root logger once per process; `role` shows who speaks ("trainer", "producer 1")."""
    level = (level or os.environ.get("LMPIPE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{role}] %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger("lmpipe")
