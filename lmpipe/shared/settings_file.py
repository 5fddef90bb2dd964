"""Config files (`--config run.toml`): flat TOML, one `setting = value` line per setting, named as
`--dry-run` prints them. Checked as flags are: an unknown key or a bad value is one line naming the file and
the key. settings.Parser applies it; precedence: flags, then LMPIPE_ variables, then the file, then defaults."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any

from lmpipe.shared.settings import CONFIG, SettingsError, Spec, parse_value


def read_config(path: str) -> dict[str, Any]:
    """A config file's keys and values: flat TOML (`seq_len = 256`); SettingsError, one line, if it is not."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise SettingsError(f"--config {path}: is a directory; name a TOML file") from None
    except OSError as exc:
        raise SettingsError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: not a TOML file ({exc})") from None


def config_value(spec: Spec, raw: Any) -> Any:
    """A TOML value as the setting's type, checked as a flag's value is; ValueError says what is wrong."""
    if spec.many:
        if isinstance(raw, str):  # as the variable: shell words
            return parse_value(spec, raw)
        if not isinstance(raw, list) or any(isinstance(x, dict | list) for x in raw):
            raise ValueError('must be a list of values, e.g. ["a.txt", "b.txt"]')
        one = dataclasses.replace(spec, many=False, optional=False)
        return [config_value(one, x if isinstance(x, str) else str(x)) for x in raw]
    if spec.optional and raw == "":
        return None
    want = {bool: "true or false", int: "an integer", float: "a number", str: "a string (quoted)"}[spec.type]
    ok = isinstance(raw, spec.type) and not (spec.type is int and isinstance(raw, bool))
    if spec.type is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw, ok = float(raw), True
    if not ok:
        raise ValueError(f"{raw!r} is not {want}")
    if spec.type is int and not -(2**63) <= raw < 2**63:
        raise ValueError(f"{raw!r} is out of range (a 64-bit integer)")
    return raw


def apply_config(
    ns: argparse.Namespace, path: str, filled: dict[str, Spec], sources: dict[str, str], others: set[str]
) -> None:
    """The settings a config file gives, where neither a flag nor an LMPIPE_ variable gave one: flags win
    over variables, variables over the file, the file over the defaults. Keys are the settings' names as
    --dry-run prints them (the flag with `_` for `-`: `seq_len`, `train_seed`); an unknown key or a bad
    value is one line naming the file and the key. A key of another command's setting (`steps` read by
    `lmpipe produce`) is left to it: one file serves the trainer and its producers."""
    for key, raw in read_config(path).items():
        spec = filled.get(key)
        if spec is None and key in others and key != CONFIG:
            continue
        if spec is None or key == CONFIG:
            near = difflib.get_close_matches(key.replace("-", "_"), sorted(others - {CONFIG}), 1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            what = "a config file cannot name another" if key == CONFIG else f"unknown key{hint}"
            raise SettingsError(
                f"{path}: {key}: {what}; keys are the settings' names, as --dry-run prints them"
            )
        try:
            value = config_value(spec, raw)
            m = spec.meta
            if m.choices is not None and value not in m.choices:
                raise ValueError(f"{value!r}: choose one of {', '.join(map(str, m.choices))}")
            if m.check is not None and value is not None and (why := m.check(value)):
                raise ValueError(f"{value!r} {why}" if why.startswith("must") else f"{value!r}: {why}")
        except ValueError as exc:
            raise SettingsError(f"{path}: {key}: {exc}") from None
        if spec.dest not in sources:  # the default: the file's value replaces it
            setattr(ns, spec.dest, value)
            sources[spec.dest] = f"{path}: {key}"
