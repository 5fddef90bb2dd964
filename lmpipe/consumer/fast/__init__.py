"""The fast paths: each replaces part of the plain model, loss, optimizer or step (consumer/model.py,
consumer/step.py, the reference that `--fast none` trains) with kernels of its own, as torchtitan's model
converters do. A module here per path, each with one small interface:

    unavailable(built) -> str | None   why it cannot run in this build (device, package, dtype, ...), or None
    apply(built) -> None               swap in its parts (fast.mix on a module, the optimizer, the runner)

build() walks PATHS once, in order (a path may need one before it), and logs in one line what ran and why
the rest did not. `--fast` (consumer/config.py) picks them: auto (every path on by default that can run
here), none, or a comma list of names (exactly those; `auto,NAME` adds an opt-in path, `auto,-NAME` leaves
one out); a named path that cannot run here is refused in one line.

A Hugging Face model (--model DIR, consumer/hf.py) has none of the modules the paths replace: each says
"not for a Hugging Face model" and none applies.

Nothing here imports torch: the settings' parser reads the names (consumer/fast/names.py).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from lmpipe.consumer.fast.names import NAMES, PATHS, Choice, Path, parse, problem

if TYPE_CHECKING:
    from lmpipe.consumer.built import Built

HF = "not for a Hugging Face model"


def unavailable(path: Path, built: Built) -> str | None:
    """Why `path` cannot run in this build, or None."""
    if getattr(built.model, "hugging_face", False):
        return HF
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
    if getattr(built.model, "hugging_face", False):  # one reason for every path
        if choice.add:
            raise ValueError(f"--fast {sorted(choice.add)[0]}: {HF} (--fast none or auto)")
        built.fast_line = f"fast paths (--fast {spec}): none; {HF} (the reference step trains it)"
        return []
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


__all__ = ["NAMES", "PATHS", "Choice", "Path", "apply_all", "mix", "parse", "problem", "unavailable"]
