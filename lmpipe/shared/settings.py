"""Settings as dataclass fields: one definition gives a setting's default, type, help, check, flag and
environment variable.

A settings class is a dataclass whose fields are made with `setting(...)`. From it:
- `add_settings(parser, Cls)` adds the flags: `--seq-len` for the field `seq_len` (or `flag=`), the type
  from the annotation (`bool`: `--x` and `--no-x`; `list[str]`: several values; `X | None`: an empty
  variable is None), `choices`, and help naming the default and the variable. An empty flag value
  (`--out "$UNSET"`) is refused, whatever the type: it meant none (or a crash) silently;
- a `Parser` fills what the command line left out from `LMPIPE_<FLAG>` (LMPIPE_SEQ_LEN=256), else from the
  field's default: flags win over the environment;
- `validate(cfg)` runs every field's `check`, then the class's `cross_check()`; a settings class calls it
  in `__post_init__`, so an invalid one cannot be made. A bad value raises SettingsError: one line;
- `from_args(ns, Cls)` builds the dataclass from parsed arguments, a bad value naming the flag or the
  variable it came from;
- `name_sources(message, ns, classes)`: messages are written once, naming a setting as `--flag VALUE` (or
  `--flag: ...`); where the environment gave that value, the variable is named instead, as a single
  field's error does (`LMPIPE_SEQ_LEN=256`). from_args does it for cross_check(), the CLI for later checks;
- `to_argv(cfg)` gives the flags that reproduce `cfg` (how `lmpipe run` starts its producers);
- `--config FILE` (TOML, `seq_len = 256`: shared/settings_file.py) fills what neither a flag nor a variable
  gave, for every command: the top parser applies it after its subcommand's parser filled its settings.
Nothing here imports torch: the parsers stay quick for `lmpipe --help` and the producer processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ENV_PREFIX = "LMPIPE_"
_META = "lmpipe.setting"
_SOURCES = "_setting_sources"  # namespace attribute: dest -> the flag or variable its value came from
_FILLED = "_setting_specs"  # namespace attribute: dest -> the Spec of each setting the parsers filled
CONFIG = "config"  # the global setting naming a config file (lmpipe/options.py; shared/settings_file.py)
# to_argv's value for an empty list or a None (`--data=<none>`, `--tokenizer=<none>`): a user's empty value
# (`--data "$UNSET"`, `--checkpoint-dir "$UNSET"`) is an error, not the built-in corpus or no checkpoints
_NONE = "<none>"

Check = Callable[[Any], "str | None"]  # None when the value is fine, else what is wrong with it


class SettingsError(ValueError):
    """A bad setting: the message is one line naming the flag or environment variable."""


@dataclasses.dataclass(frozen=True)
class Meta:
    help: str
    check: Check | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None  # without the dashes; default: the field name with '-' for '_'
    metavar: str | None = None
    group: str | None = None  # argparse group title; default: the one add_settings is given
    env: bool = True  # also read LMPIPE_<FLAG>
    hidden: bool = False  # left out of --help (internal flags)
    required: bool = False


def setting(default: Any, *, help: str, **meta: Any) -> Any:
    """A dataclass field carrying its setting's metadata (see Meta for the keywords)."""
    md = {_META: Meta(help=help, **meta)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=md)
    return dataclasses.field(default=default, metadata=md)


def inherit(cls: type, name: str) -> Any:
    """The same setting as `cls.name`: its default, help and check (BatchSpec takes PipelineConfig's)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


# -- checks -------------------------------------------------------------------------------------------


def at_least(low: float) -> Check:
    return lambda v: None if v >= low else f"must be {'a number ' if v != v else ''}>= {low}"  # nan != nan


def between(low: float, high: float) -> Check:
    return lambda v: None if low <= v <= high else f"must be in {low}..{high}"


def positive(v: float) -> str | None:
    if v > 0 and math.isfinite(v):
        return None
    return "must be > 0" if v <= 0 else "must be a finite number > 0"


def existing_dir(v: str) -> str | None:
    if Path(v).is_dir():
        return None
    return "is not a directory" if Path(v).exists() else "no such directory"


# -- what a field says --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # field name
    flag: str  # without dashes
    dest: str  # argparse namespace attribute
    env: str | None  # LMPIPE_<FLAG>
    type: type  # bool, int, float or str (of each item, for lists)
    optional: bool  # `X | None`: an empty variable means None (an empty flag value is refused)
    many: bool  # list[X]
    default: Any
    meta: Meta


def _unpack(tp: Any) -> tuple[type, bool, bool]:
    optional = many = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = len(args) < len(typing.get_args(tp)), args[0]
    if typing.get_origin(tp) is list:
        many, tp = True, typing.get_args(tp)[0]
    if tp not in (bool, int, float, str):
        raise TypeError(f"settings support bool, int, float, str, list[str] and X | None, not {tp!r}")
    return tp, optional, many


def specs(cls: type) -> tuple[Spec, ...]:
    """The settings of a settings dataclass, in field order (read once per class)."""
    return _specs(cls)


@functools.cache
def _specs(cls: type) -> tuple[Spec, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if meta is None:
            continue
        tp, optional, many = _unpack(hints[f.name])
        flag = meta.flag or f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        env = ENV_PREFIX + flag.upper().replace("-", "_") if meta.env else None
        out.append(Spec(f.name, flag, flag.replace("-", "_"), env, tp, optional, many, default, meta))
    return tuple(out)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_value(spec: Spec, raw: str) -> Any:
    """A string from the command line or the environment as the field's type; ValueError if it is not."""
    if spec.many:
        try:  # shell quoting, so that LMPIPE_DATA="my corpus.jsonl other.jsonl" can name a path with a space
            words = shlex.split(raw)
        except ValueError as exc:
            raise ValueError(f"{raw!r}: {exc}") from None
        return [parse_value(dataclasses.replace(spec, many=False, optional=False), r) for r in words]
    if spec.optional and raw == "":
        return None
    if spec.type is bool:
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
        return raw.lower() in _TRUE
    if spec.type is int:
        try:
            v = int(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if not -(2**63) <= v < 2**63:  # past int64, msgpack's hello and numpy failed with a traceback
            raise ValueError(f"{raw!r} is out of range (a 64-bit integer)")
        return v
    if spec.type is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
    return raw


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if v is None or v == []:
        return "none"
    return str(v)


def source_of(ns: argparse.Namespace, spec: Spec) -> str:
    """Where a parsed setting's value came from: `--flag`, `LMPIPE_X`, a config file's `FILE: key`, or
    `default`."""
    return getattr(ns, _SOURCES, {}).get(spec.dest) or "default"


def show(v: Any) -> str:
    """A setting's value as help and --dry-run print it: on/off, none, the items of a list."""
    if isinstance(v, list) and v:
        return " ".join(shlex.quote(str(x)) for x in v)
    return _show(v)


# -- argparse -----------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with settings filled from the environment after parsing, and errors as one line."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fill: list[Spec] = []

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        sources = ns.__dict__.setdefault(_SOURCES, {})
        filled = ns.__dict__.setdefault(_FILLED, {})  # a subcommand's parser's, copied up with its values
        for spec in self._fill:
            filled[spec.dest] = spec
            if hasattr(ns, spec.dest):  # given as a flag (here, or to a subcommand and copied up)
                sources.setdefault(spec.dest, "--" + spec.flag)
                continue
            raw = None if spec.env is None else os.environ.get(spec.env)
            if raw is None:
                value = spec.default
            else:
                try:
                    value = parse_value(spec, raw)
                except ValueError as exc:
                    self.error(f"{spec.env}: {exc}")
                sources[spec.dest] = spec.env
            setattr(ns, spec.dest, value)
        if any(spec.dest == CONFIG for spec in self._fill) and getattr(ns, CONFIG, None):
            from lmpipe.shared.settings_file import apply_config

            try:  # the parser that fills --config (the top one) applies it, to every setting parsed
                apply_config(ns, ns.config, filled, sources, self._every_setting())
            except SettingsError as exc:
                self.error(str(exc))
        return ns, extras

    def _every_setting(self) -> set[str]:
        """The names of the settings of this parser and its subcommands' (a key of another command's)."""
        names = {spec.dest for spec in self._fill}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names |= sub._every_setting() if isinstance(sub, Parser) else set()
        return names


def _argtype(spec: Spec, required: bool) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        if spec.many and raw == _NONE:
            return raw  # from_args drops it
        if spec.optional and raw == _NONE:
            return None
        if raw == "":  # any type: an unset $VAR was read as none, silently (a crash where required)
            advice = (
                f"--{spec.flag} is required"
                if required
                else f"leave --{spec.flag} out to use its default ({_show(spec.default)})"
            )
            raise argparse.ArgumentTypeError(f"an empty value (an unset shell variable?); {advice}")
        try:
            return parse_value(dataclasses.replace(spec, many=False), raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def add_settings(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    *,
    only: tuple[str, ...] | None = None,
    env: bool = True,
    fill: bool = True,
    required: tuple[str, ...] = (),
    hidden: tuple[str, ...] = (),
    helps: dict[str, str] | None = None,
) -> None:
    """Add a flag per setting of `cls` (or the `only` ones). env=False: flags only (one-shot commands);
    fill=False: the flag is accepted here but its default is filled by a parent parser (global options);
    `hidden`: accepted (a whole config's flags round-trip) but left out of --help, where they mean nothing;
    `helps`: a field's help as this command reads it (prepare's --data takes no shard directory)."""
    helps = helps or {}
    for spec in specs(cls):
        if only is not None and spec.name not in only:
            continue
        if not env:
            spec = dataclasses.replace(spec, env=None)
        m = spec.meta
        name = m.group or title
        g = next((g for g in parser._action_groups if g.title == name), None)
        g = g or parser.add_argument_group(name)
        needed = m.required or spec.name in required
        where = f"; ${spec.env}" if spec.env else ""
        text = helps.get(spec.name, m.help)
        text = text if needed else f"{text} [default: {_show(spec.default)}{where}]"  # required: no default
        text = argparse.SUPPRESS if m.hidden or spec.name in hidden else text.replace("%", "%%")  # %-formats
        kwargs: dict[str, Any] = dict(dest=spec.dest, default=argparse.SUPPRESS, help=text)
        if needed:
            kwargs["required"] = True
        if spec.type is bool:
            g.add_argument("--" + spec.flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            metavar = m.metavar or {int: "N", float: "X"}.get(spec.type)
            kwargs.update(type=_argtype(spec, needed), choices=m.choices, metavar=metavar)
            if (
                spec.many
            ):  # the flag with no value would mean the default silently (an unset $VAR, an empty glob)
                kwargs["nargs"] = "+"
            g.add_argument("--" + spec.flag, **kwargs)
        if fill and isinstance(parser, Parser):
            parser._fill.append(spec)


# -- building and checking ----------------------------------------------------------------------------


def field_problems(
    cls: type, values: dict[str, Any], sources: dict[str, str | None] | None = None
) -> list[str]:
    """What is wrong with the `values` of settings of `cls` (missing ones are not looked at), each naming
    the flag (or the variable it came from, per `sources`) and the value."""
    out = []
    for spec in specs(cls):
        if spec.name not in values or (values[spec.name] is None and spec.optional):
            continue
        v = values[spec.name]
        shown = " ".join(shlex.quote(str(x)) for x in (v if spec.many else [v]))
        src = (sources or {}).get(spec.name)
        src = f"{src}={shown}" if src and not src.startswith("-") else f"--{spec.flag} {shown}"
        m = spec.meta
        if m.choices is not None and v not in m.choices:
            noun = spec.name.replace("_", " ")
            out.append(f"{src}: unknown {noun}; choose one of {', '.join(map(str, m.choices))}")
        elif m.check is not None and (why := m.check(v)):
            out.append(f"{src}: {why}")
    return out


def validate(cfg: Any) -> None:
    """Every field's check, then the class's cross_check(); a settings class calls it in __post_init__."""
    found = field_problems(type(cfg), {s.name: getattr(cfg, s.name) for s in specs(type(cfg))})
    if not found and hasattr(cfg, "cross_check"):
        found = cfg.cross_check()
    if found:
        raise SettingsError("; ".join(found))


def from_args(ns: argparse.Namespace, cls: type) -> Any:
    """The dataclass from a parsed namespace (fields it lacks keep their defaults), validated: a bad value
    names the flag or the variable it came from."""
    given = getattr(ns, _SOURCES, {})
    values, sources = {}, {}
    for spec in specs(cls):
        if hasattr(ns, spec.dest):
            value = getattr(ns, spec.dest)
            # to_argv's empty list, and an empty variable (parsed to []), mean none
            values[spec.name] = [v for v in value if v != _NONE] if spec.many else value
            sources[spec.name] = given.get(spec.dest)
    if found := field_problems(cls, values, sources):
        raise SettingsError("; ".join(found))
    try:
        cfg = cls(**values)
        validate(cfg)  # again if __post_init__ did: cheap, and classes without one are checked too
    except SettingsError as exc:  # cross_check() names flags: say which values the environment gave
        raise SettingsError(name_sources(str(exc), ns, (cls,))) from None
    return cfg


def name_sources(message: str, ns: argparse.Namespace, classes: Iterable[type]) -> str:
    """`message` with each mention of a setting's value that came from the environment naming its variable
    instead of its flag, as single-field errors do: `--seq-len 256` becomes `LMPIPE_SEQ_LEN=256`,
    `--data: ...` becomes `LMPIPE_DATA: ...`, a bool's `--compile` (`--no-compile`) `LMPIPE_COMPILE=on`
    (`off`). One item of a list the variable gave is named as in it: `--data b.txt` becomes
    `b.txt (in LMPIPE_DATA)`. Settings said together, `--rank/--world-size 1/3`, are said one by one where
    the environment gave any of them: `LMPIPE_RANK=1 and --world-size 3`. A flag with another value than
    the setting's (advice: `--accum N`) stays a flag."""
    given = getattr(ns, _SOURCES, {})
    by_flag = {s.flag: s for cls in classes for s in specs(cls)}
    message = _name_combined(message, ns, by_flag, given)
    for spec in by_flag.values():
        var = given.get(spec.dest)
        if var and not var.startswith("-") and hasattr(ns, spec.dest):
            message = _name_variable(message, spec, var, getattr(ns, spec.dest))
    return message


# a value ends where the sentence goes on: `--device cuda: ...`, but not `--device cuda:1`
_VALUE_END = r"(?=$|[\s,;)]|:(\s|$))"


def _written(spec: Spec, value: Any) -> set[str]:
    """How a message may write the setting's value: as given, shell-quoted, `0.5` for 5e-1, `1,000`."""
    items = (value if spec.many else [value]) if value is not None else []
    written = {" ".join(map(str, items)), " ".join(shlex.quote(str(x)) for x in items)}
    if isinstance(value, float):
        written.add(f"{value:g}")
    if type(value) is int:  # messages print counts with thousands separators: 1,000
        written.add(f"{value:,}")
    return written - {""}


def _name_combined(message: str, ns: argparse.Namespace, by_flag: dict[str, Spec], given: dict) -> str:
    """`--rank/--world-size 1/3`, where each value is its setting's and the environment gave one of them
    at least: each said on its own, `LMPIPE_RANK=1 and --world-size 3`."""

    def one_by_one(m: re.Match) -> str:
        flags, values = m.group(1).split("/--"), m.group(2).split("/")
        parts, named = [], False
        if len(flags) != len(values):
            return m.group(0)
        for flag, text in zip(flags, values):
            spec = by_flag.get(flag)
            if spec is None or spec.type is bool or not hasattr(ns, spec.dest):
                return m.group(0)
            if text not in _written(spec, getattr(ns, spec.dest)):
                return m.group(0)  # not the value set: advice, or another value
            var = given.get(spec.dest)
            if var and not var.startswith("-"):
                parts.append(f"{var}={text}")
                named = True
            else:
                parts.append(f"--{flag} {text}")
        if not named:
            return m.group(0)
        return ", ".join(parts[:-1]) + " and " + parts[-1]

    flags, values = r"--([\w-]+(?:/--[\w-]+)+)", r"((?:[^\s/,;)]+?/)+[^\s/,;)]+?)"
    return re.sub(rf"(?<![\w-]){flags} {values}{_VALUE_END}", one_by_one, message)


def _name_variable(message: str, spec: Spec, var: str, value: Any) -> str:
    def sub(pattern: str, text: str) -> None:
        nonlocal message  # a function for the replacement: a path's backslashes are not escapes
        message = re.sub(rf"(?<![\w-]){pattern}", lambda _: text, message)

    flag = re.escape(spec.flag)
    if spec.type is bool:  # the flag that states the value: --x when on, --no-x when off
        sub(rf"--{'' if value else 'no-'}{flag}(?![\w-])", f"{var}={_show(value)}")
        return message
    sub(rf"--{flag}(?=:(\s|$))", var)
    for text in sorted(_written(spec, value), key=len, reverse=True):
        sub(rf"--{flag} {re.escape(text)}{_VALUE_END}", f"{var}={text}")
    if spec.many and len(value or []) > 1:  # one of the items: `--data b.txt` is `b.txt (in LMPIPE_DATA)`
        items = {str(x) for x in value} | {shlex.quote(str(x)) for x in value}
        for text in sorted(items - {""}, key=len, reverse=True):
            sub(rf"--{flag} {re.escape(text)}{_VALUE_END}", f"{text} (in {var})")
    return message


def to_argv(cfg: Any) -> list[str]:
    """Flags that reproduce every setting of `cfg`, whatever the environment says."""
    argv: list[str] = []
    for spec in specs(type(cfg)):
        v, flag = getattr(cfg, spec.name), "--" + spec.flag
        if spec.type is bool:
            argv.append(flag if v else f"--no-{spec.flag}")
        elif spec.many:  # an empty list as the one value that means none: the flag wants at least one
            argv += [flag, *map(str, v)] if v else [f"{flag}={_NONE}"]
        else:
            argv += [f"{flag}={_NONE}"] if v is None else [flag, str(v)]
    return argv
