"""The fast paths by name, and `--fast`'s grammar: what the setting's parser reads (consumer/config.py), with
no import of torch or of anything of ours."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Path:
    name: str  # as --fast spells it
    module: str  # consumer/fast/<module>.py: its unavailable and apply
    default: bool = True  # on under --fast auto
    cuda: bool = True  # needs a CUDA device
    needs: tuple[str, ...] = ()  # packages its module imports at the top


PATHS: tuple[Path, ...] = (
    Path("loss-kernel", "loss", needs=("triton",)),
    Path("head-gemm", "head_gemm", needs=("triton",)),
    Path("gelu-epilogue", "mlp_kernel"),
    # opt-in: 0.992-1.013x tokens/s on an H100 (bench/results/qkv-h100-2026-11-27.md)
    Path("qkv-backward", "qkv_kernel", default=False, needs=("triton",)),
    Path("adamw", "adamw", needs=("triton",)),
    Path("clip-in-step", "clip", cuda=False),
    Path("step-graph", "step_graph"),
    # opt-in: 1.002x tokens/s on an H200 (bench/results/memset-nodes-h200-2026-11-28.md)
    Path("memset-nodes", "memset_nodes", default=False),
)
NAMES = tuple(p.name for p in PATHS)


@dataclass(frozen=True)
class Choice:
    """--fast parsed: start from auto's defaults or from nothing, then add and remove names."""

    auto: bool
    add: frozenset[str]
    remove: frozenset[str]

    def wants(self, path: Path) -> bool:
        return path.name in self.add or (self.auto and path.default and path.name not in self.remove)


def parse(spec: str) -> Choice:
    """--fast's value; ValueError (one line) for a name that is no path."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if items in (["auto"], ["none"]):
        return Choice(items == ["auto"], frozenset(), frozenset())
    auto = bool(items) and items[0] == "auto"
    add: set[str] = set()
    remove: set[str] = set()
    for item in items[1:] if auto else items:
        name = item[1:] if item.startswith("-") else item
        if name not in NAMES:
            raise ValueError(f"{name!r} is no fast path; choose from {', '.join(NAMES)} (or auto, none)")
        if item.startswith("-") and not auto:
            raise ValueError(f"-{name} leaves a path out of auto's: write auto,-{name}")
        (remove if item.startswith("-") else add).add(name)
    if not items:
        raise ValueError("empty; use auto, none or a comma list of " + ", ".join(NAMES))
    return Choice(auto, frozenset(add), frozenset(remove))


def problem(spec: str) -> str | None:
    """The setting's check (shared/settings.py)."""
    try:
        parse(spec)
    except ValueError as e:
        return str(e)
    return None
