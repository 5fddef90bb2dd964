"""The README read as the tests read it: its bash blocks, its sections, the lmpipe commands of a line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path


def bash_blocks(text: str) -> list[list[str]]:
    """Every ```bash block: its commands, one a line, comments and continuation lines joined."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = body.replace("\\\n", " ").splitlines()
        blocks.append([ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")])
    return blocks


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def lmpipe_commands(line: str) -> list[list[str]]:
    """The lmpipe invocations of one shell line (`a && b`), as argv after the program name."""
    out = []
    for part in line.split("&&"):
        words = shlex.split(part, comments=True)
        if words and Path(words[0]).name == "lmpipe":
            out.append(words[1:])
    return out
