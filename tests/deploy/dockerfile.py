"""A Dockerfile as its instructions, for the static checks of tests/unit/deploy."""

from __future__ import annotations

import re
from pathlib import Path


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, the rest) per instruction, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out
