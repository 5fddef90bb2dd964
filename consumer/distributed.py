"""Data parallelism under `torchrun`: one trainer rank per GPU, each with its own receiver and producers.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; rank r binds the trainer's port + 2r (data, control) and is fed
by producers started with `--rank r --world-size R` (which own a disjoint share of the corpus). Gradients
are averaged by DDP over NCCL (gloo on CPU). Host-side agreement, once per step, goes over a separate gloo
group so that it never waits on the GPU: the step's target-token count summed over ranks (the loss is
normalised by it, so R ranks make exactly the update one GPU would make on the union of their batches), and
whether every rank still has data and nobody asked to stop (ranks stop together, or NCCL would hang).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmpipe.consumer.config import TrainConfig
from lmpipe.shared.config import PipelineConfig


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host_group: Any = field(default=None, repr=False)  # gloo group for host scalars

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, targets: int, has_data: bool, stopping: bool) -> tuple[int, bool, bool]:
        """(targets summed over ranks, does any rank have data, does any rank want to stop)."""
        if not self.enabled:
            return targets, has_data, stopping
        t = torch.tensor([targets, int(has_data), int(stopping)], dtype=torch.int64)
        dist.all_reduce(t, group=self.host_group)
        return int(t[0]), bool(t[1]), bool(t[2])

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.host_group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.host_group)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def from_env(device: str) -> Dist:
    """The torchrun world this process is part of (a world of one without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    # The first step waits for every rank's producers; don't let NCCL's watchdog call that a hang.
    timeout = datetime.timedelta(minutes=30)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=timeout,
        device_id=torch.device("cuda", local_rank) if cuda else None,
    )
    host = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    return Dist(rank, world, local_rank, host)


def per_rank(pcfg: PipelineConfig, tcfg: TrainConfig, d: Dist) -> tuple[PipelineConfig, TrainConfig]:
    """Rank r of R (torchrun) binds port + 2r, serves metrics after the lower ranks' trainer and
    producers, logs its documents to its own file, and expects producers of rank r."""
    r, world = d.rank, d.world_size
    if pcfg.world_size not in (1, world) or (pcfg.world_size == world and pcfg.rank not in (0, r)):
        raise ValueError(
            f"--rank/--world-size {pcfg.rank}/{pcfg.world_size} disagree with torchrun's {r}/{world}; "
            "leave them out under torchrun"
        )
    pcfg = replace(pcfg, rank=r, world_size=world, port=pcfg.port + 2 * r)
    metrics = tcfg.metrics_port
    if metrics:  # 0 (any free port) and -1/None (off) stay as they are
        metrics += r * (pcfg.producers + 1)
    doc_log = tcfg.doc_log
    if doc_log:
        path = Path(doc_log)
        doc_log = str(path.with_name(f"{path.stem}.rank{r}{path.suffix}"))
    return pcfg, replace(tcfg, metrics_port=metrics, doc_log=doc_log)
