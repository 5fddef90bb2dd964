"""The fast paths: each replaces part of the plain model, loss, optimizer or step (consumer/model.py,
consumer/step.py, the reference that `--fast none` trains) with kernels of its own, as torchtitan's model
converters do. A module here per path, each with one small interface:

    unavailable(built) -> str | None   why it cannot run in this build (device, package, dtype, ...), or None
    apply(built) -> None               swap in its parts (fast.mix on a module, the optimizer, the runner)

build() walks PATHS once, in order (a path may need one before it), and logs in one line what ran and why
the rest did not. `--fast` (consumer/config.py) picks them: auto (every path on by default that can run
here), none, or a comma list of names (exactly those; `auto,NAME` adds an opt-in path, `auto,-NAME` leaves
one out); a named path that cannot run here is refused in one line.

Nothing here imports torch: the settings' parser reads the names.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmpipe.consumer.build import Built


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


def unavailable(path: Path, built: Built) -> str | None:
    """Why `path` cannot run in this build, or None."""
    if path.cuda and built.device.type != "cuda":
        return f"it needs CUDA, not {built.device.type}"
    for package in path.needs:
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    return importlib.import_module(f"{__name__}.{path.module}").unavailable(built)


def apply_all(spec: str, built: Built) -> list[str]:
    """Walk PATHS once: apply each path --fast wants and can run here, refuse (ValueError, one line) a
    named one that cannot, and log what ran and why the rest did not. The names applied, in order."""
    choice = parse(spec)
    ran: list[str] = []
    off: list[str] = []
    unnamed: list[str] = []
    for path in PATHS:
        if not choice.wants(path):
            if choice.auto and not path.default and path.name not in choice.remove:
                off.append(f"{path.name} (opt-in: --fast auto,{path.name})")
            else:
                unnamed.append(path.name)
            continue
        why = unavailable(path, built)
        if why and path.name in choice.add:
            raise ValueError(f"--fast {path.name}: {why}")
        if why:
            off.append(f"{path.name} ({why})")
            continue
        importlib.import_module(f"{__name__}.{path.module}").apply(built)
        ran.append(path.name)
        built.fast.append(path.name)
    if unnamed:
        off.append(f"{', '.join(unnamed)} (not asked for)")
    # logged by the trainer after a resume's checks, so that a refused checkpoint stays one line
    built.fast_line = (
        f"fast paths (--fast {spec}): {', '.join(ran) or 'none'}; off: {'; '.join(off) or 'none'}"
    )
    return ran


_MIXED: dict[tuple[type, type], type] = {}


def mix(obj: object, subclass: type) -> None:
    """Give `obj` a class that is both `subclass` (a subclass of a plain class that overrides one of its
    methods) and its own class, so that paths compose: the one hook the plain model offers. Its
    parameters, state dict and initialisation stay as they were."""
    cls = type(obj)
    if issubclass(cls, subclass):
        return
    key = (subclass, cls)
    if key not in _MIXED:
        _MIXED[key] = type(f"{subclass.__name__}_{cls.__name__}", (subclass, cls), {})
    obj.__class__ = _MIXED[key]
