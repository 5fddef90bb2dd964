"""A trainer's coordinator without sockets, for in-process tests of the control side (what it registers,
assigns and says): its ROUTER is a stand-in that keeps what was sent."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from lmpipe.consumer.admission import Admission
from lmpipe.consumer.coordinator import Coordinator
from lmpipe.consumer.ledger import Ledger
from lmpipe.consumer.quiet import Rejects
from lmpipe.shared import messages
from lmpipe.shared.config import PipelineConfig
from lmpipe.shared.metrics import TrainerMetrics


class Router:
    """Stands in for the ROUTER socket: keeps what the coordinator sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> Router:
        self.sent.append((frames[0], messages.unpack(frames[1])))
        return self

    def done(self) -> bool:  # the "future" of a send that finished at once
        return False


def coordinator(shards: int, producers: int) -> Coordinator:
    metrics = TrainerMetrics(CollectorRegistry())
    cfg = PipelineConfig(producers=producers)
    co = Coordinator(cfg, Ledger(shards, "s"), metrics, Admission({}, "", None), Rejects(metrics))
    co._router = Router()  # type: ignore[assignment]
    return co
