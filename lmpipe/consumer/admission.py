"""What a producer's hello must match to be welcomed, and what its hellos report (skipped records).

A new producer must speak the trainer's wire version and match its config fingerprint; the first producer
pins what the trainer was not given: the corpus (`data`: names and sizes), its files' contents and each
location's remote object versions. Every refusal says what differs and what to change.
"""

from __future__ import annotations

from typing import Any

from lmpipe.consumer.quiet import printable
from lmpipe.shared import messages
from lmpipe.shared.config import mismatches
from lmpipe.shared.wire import WIRE_VERSION


class Admission:
    """The trainer's side of the handshake's checks, and the pins the first producers set."""

    def __init__(self, fingerprint: dict[str, Any], data_content: str, data_versions: list[str] | None):
        # the trainer's own dict: the first producer pins "data" (unless given) for checkpoints too
        self.fingerprint = fingerprint
        # the corpus files' contents (a hello's `data_content`): given (the trainer's --data, a resumed
        # checkpoint's header) or pinned by the first producer that sends one; "": none yet
        self.data_content = data_content
        # remote objects' versions (a hello's `data_versions`), one pin per location (the objects' URLs): given
        # (the trainer's --data, a resumed checkpoint's header) or pinned by the first producer reading them
        self.data_versions = {messages.version_location(v): v for v in data_versions or []}

    def admit(self, hello: messages.Hello) -> tuple[str, str] | None:
        """(reason, REFUSAL_REASONS code) when a new producer's hello is refused; None when it is
        welcome, after pinning what it is the first to say."""
        pinned = bool(self.fingerprint.get("data"))
        # the welcome names the global shards a producer makes (wire 6): its --rank/--world-size, those of the
        # job it was started for, decide nothing, and a job that torchrun restarted with fewer ranks takes it
        skip = ("rank", "world_size") + (() if pinned else ("data",))
        diff = mismatches(self.fingerprint, hello.fingerprint, skip=skip)
        if diff:
            return "config mismatch: " + "; ".join(diff), "config_mismatch"
        if self.data_content and hello.data_content and hello.data_content != self.data_content:
            return _other_content(hello.data_content, self.data_content), "config_mismatch"
        where_versions = messages.version_location(hello.data_versions)
        versions = self.data_versions.get(where_versions) if hello.data_versions else None
        if versions and versions != hello.data_versions:
            return _other_versions(hello.data_versions, versions), "config_mismatch"
        if hello.data_versions and not versions:  # the first producer reading these objects pins them
            self.data_versions[where_versions] = hello.data_versions
        if not pinned:
            self.fingerprint["data"] = hello.fingerprint.get("data", "")  # the first producer pins the corpus
        if not self.data_content:
            self.data_content = hello.data_content  # and the first that says it, the files' contents
        return None


class SkippedRecords:
    """The producers' skipped bad records per shard and reason (messages.Hello.skipped). Whoever reads a
    shard reads it in the same order from its epoch's start, so every holder's count is of the same records
    so far: the highest is what was read, however often the shard moved or a producer restarted, and
    whatever host and pid its producers had."""

    def __init__(self) -> None:
        self._highest: dict[tuple[int, str], int] = {}

    def update(self, skipped: dict[str, int], shards: int) -> bool:
        """Take one hello's or bye's counts ("<shard>:<reason>" -> n); True if any count rose."""
        rose = False
        for key, n in skipped.items():
            shard, _, reason = key.partition(":")
            if not (shard.isdigit() and int(shard) < shards and reason and n >= 0):
                continue  # not a count of one of this session's shards
            at = (int(shard), printable(reason, 40))
            if n > self._highest.get(at, 0):
                self._highest[at], rose = n, True
        return rose

    def by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, reason), n in self._highest.items():
            out[reason] = out.get(reason, 0) + n
        return out


def _other_content(theirs: str, ours: str) -> str:
    """The refusal of a producer whose corpus files match `data` (names and sizes) but not in content."""
    return (
        f"config mismatch: data_content: the producer's corpus files have the same names and sizes but other "
        f"content (producer has {printable(theirs, 40)!r}, trainer has {ours!r}); serve the same files"
    )


def _other_versions(theirs: str, ours: str) -> str:
    """The refusal of a producer reading the run's remote objects after one of them changed."""
    return (
        f"config mismatch: data_versions: the producer's corpus objects have the same names and sizes but other "
        f"versions in their store (producer has {printable(theirs, 60)!r}, trainer has {ours!r}): an object "
        f"was rewritten since the run began; serve the objects it was trained on"
    )


def version_skew(wire: int) -> str:
    """The refusal of a producer of another wire version, naming both."""
    theirs = f"wire version {wire}" if wire else "wire version 2 or older (its hello names none)"
    return (
        f"wire version mismatch: the producer speaks {theirs}, the trainer speaks wire version "
        f"{WIRE_VERSION}; run the same lmpipe version on both sides"
    )
