"""docker-compose.yml as Compose reads it: the merge tags, merging an override file, `${VAR:-default}`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml


class ComposeLoader(yaml.SafeLoader):
    """PyYAML with Compose's merge tags: `!reset` drops an attribute, `!override` replaces it."""


class Reset:
    pass


class Override:
    def __init__(self, value):
        self.value = value


def _override(loader, node):
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", _override)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def plain(doc):
    """The document as the schema sees it: a reset attribute is null, an override its value."""
    if isinstance(doc, dict):
        return {k: plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [plain(v) for v in doc]
    if isinstance(doc, Reset):
        return None
    if isinstance(doc, Override):
        return plain(doc.value)
    return doc


def merge_compose(base, over):
    """Compose's merge rules, as far as these files use them: mappings merge, sequences append, command and
    entrypoint are replaced, !reset removes, !override replaces."""
    if isinstance(over, Override):
        return over.value
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            elif k in ("command", "entrypoint") or k not in out:
                out[k] = plain(v)
            else:
                out[k] = merge_compose(out[k], v)
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + over
    return plain(over)


_INTERP = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


def interpolate(value, env: dict[str, str]) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` (the default also replaces an empty value)."""
    value = str(value)
    out = _INTERP.sub(lambda m: env.get(m["name"]) or (m["default"] or ""), value)
    assert "$" not in out, f"interpolation this test does not know: {value!r}"
    return out


def service_env(svc: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    raw = svc.get("environment") or {}
    assert isinstance(raw, dict), "environment is written as a mapping"
    return {k: interpolate(v, env or {}) for k, v in raw.items()}


def service_argv(svc: dict) -> list[str]:
    return [str(a) for a in (svc.get("entrypoint") or [])] + [str(a) for a in (svc.get("command") or [])]
