"""What every config dataclass shares: the error type, the field checks, (de)serialisation.

A config is a dataclass that subclasses :class:`ConfigBase` and validates itself in
``__post_init__`` with the checks below; each raises :class:`ConfigError` naming the field, the
offending value and the allowed range (``ModelConfig.hidden_size=0 is out of range; allowed
[1, inf]``). :class:`ConfigBase` gives it ``to_dict``/``from_dict`` (nested configs built from
nested mappings, unknown keys refused) and YAML ``save``/``load``.

Imports only the standard library and PyYAML: every config builds on it (the model's
:mod:`unicache_train.model.config`, the data's :mod:`unicache_train.data.config`, the run's
:mod:`unicache_train.train.config`, the compressors' :mod:`unicache_train.compress.config`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

__all__ = [
    "ConfigError",
    "ConfigBase",
    "check_range",
    "check_int",
    "check_choice",
    "check_bool",
    "check_nested",
    "build_config",
    "interval",
    "load_yaml",
    "load_yaml_file",
    "apply_overrides",
]

C = TypeVar("C", bound="ConfigBase")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, value and allowed range."""


# --------------------------------------------------------------------------------- YAML
class _YAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads every usual number notation as a number.

    PyYAML implements YAML 1.1, whose float pattern needs a dot and a signed exponent: ``1e-4``,
    ``1E-4``, ``1e4`` and ``-.5`` come back as *strings* there (then refused as "expected a
    number"). YAML 1.2 and every other parser read them as floats; so do we.
    """


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?)$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str | Path | None = None) -> Any:
    """Parse YAML text (a config file or one ``section.field=value`` override's value) with
    :class:`_YAMLLoader`: ``1e-4``, ``1E-4``, ``.5``, ``-.5``, ``1_000`` are numbers.

    Plain data only: a tag that would build an object (``!!python/object``, ``!!python/name``)
    is refused, as is any syntax error, in one :class:`ConfigError` line naming ``source`` (the
    file, or the override) and the line.
    """
    try:
        return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(err, source)) from None
    except RecursionError:
        raise ConfigError(f"{source or 'YAML'}: nested too deeply to read") from None


def load_yaml_file(path: str | Path) -> Any:
    """:func:`load_yaml` of a file, read as UTF-8 (errors name the file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return load_yaml(text, path)


def _yaml_error(err: yaml.YAMLError, source: str | Path | None) -> str:
    where = str(source) if source is not None else "YAML"
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if mark is not None:
        where += f": line {mark.line + 1}, column {mark.column + 1}"
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in problem:
        return (
            f"{where}: {problem.split(' for the tag ')[-1].strip()} is refused: configs "
            "are plain data (mappings, lists, strings, numbers, booleans); a tag that builds "
            "objects could run code"
        )
    return f"{where}: invalid YAML ({problem})"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML, :func:`load_yaml`) to a nested
    dict in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = data
        parts = key.lstrip("-").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = load_yaml(raw, f"override {item!r}")
    return data


# --------------------------------------------------------------------------------- checks
def interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    """The allowed range as text: ``[0, 1)``, ``(0, inf)``."""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    lo_s = "-inf" if lo is None else lo
    hi_s = "inf" if hi is None else hi
    return f"{left}{lo_s}, {hi_s}{right}"


def check_range(
    obj: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """``getattr(obj, name)`` must be a finite number in the range (inf and NaN are refused:
    no config field of ours means anything at infinity)."""
    value = getattr(obj, name)
    cls = type(obj).__name__
    allowed = interval(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{cls}.{name}={value!r}: expected a number in {allowed}, got {type(value).__name__}"
        )
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if not math.isfinite(value) or bad_lo or bad_hi:
        raise ConfigError(f"{cls}.{name}={value!r} is out of range; allowed {allowed}")


def check_int(obj: Any, name: str, lo: int | None = None, hi: int | None = None) -> None:
    """``getattr(obj, name)`` must be an integer (not a bool) in ``[lo, hi]``."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{type(obj).__name__}.{name}={value!r}: expected an integer in "
            f"{interval(lo, hi, False, False)}"
        )
    check_range(obj, name, lo, hi)


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    """``getattr(obj, name)`` must be one of ``choices``."""
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(
            f"{type(obj).__name__}.{name}={value!r} is not allowed; choose one of {list(choices)}"
        )


def check_bool(obj: Any, name: str) -> None:
    """``getattr(obj, name)`` must be True or False (not 0/1, not a string)."""
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: expected true or false")


# --------------------------------------------------------------------------------- base class
@dataclass
class ConfigBase:
    """Mixin of the config dataclasses: ``to_dict``, ``from_dict``, ``save``, ``load``.

    A field annotated with another :class:`ConfigBase` dataclass (or ``X | None``) is built from
    a nested mapping (``RunConfig.model`` from ``{"hidden_size": 64}``). A config whose nested
    sections take defaults from one of its own fields (a preset) completes the mapping in
    :meth:`complete_mapping` first. Unknown keys are refused, naming the section:
    ``unknown field(s) ['hiden_size'] in model``.
    """

    #: How error messages name this config as the root of :meth:`from_dict`: the class name by
    #: default (sections then read ``UniCacheConfig.head_merge``); ``""`` names the sections by
    #: their keys alone (``model``, ``data.synthetic``) and the root "the config".
    config_path: ClassVar[str | None] = None

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (sub-configs as dicts), what :meth:`from_dict` reads back."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any] | None) -> C:
        """Build from a nested mapping (e.g. a YAML file); unknown keys raise
        :class:`ConfigError` naming the section."""
        where = cls.__name__ if cls.config_path is None else cls.config_path
        return build_config(cls, data or {}, where)

    def save(self, path: str | Path) -> Path:
        """Write the resolved config as YAML (parents created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @classmethod
    def load(cls: type[C], path: str | Path, overrides: list[str] | None = None) -> C:
        """Read a YAML config and apply ``section.field=value`` overrides."""
        path = Path(path)
        data = load_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        apply_overrides(data, overrides or [])
        return cls.from_dict(data)


def check_nested(obj: Any) -> None:
    """Every field of ``obj`` annotated with a config dataclass must hold an instance of it."""
    for name, (sub, optional) in _subconfigs(type(obj)).items():
        value = getattr(obj, name)
        if not isinstance(value, sub) and not (optional and value is None):
            raise ConfigError(f"{type(obj).__name__}.{name}={value!r}: expected a {sub.__name__}")


@functools.cache
def _subconfigs(cls: type) -> dict[str, tuple[type, bool]]:
    """Fields of dataclass ``cls`` annotated with one :class:`ConfigBase` dataclass ``X`` or with
    ``X | None``: name -> (``X``, whether None is allowed)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        args = typing.get_args(hint)
        optional = len(args) == 2 and type(None) in args
        cand = next(a for a in args if a is not type(None)) if optional else hint
        if isinstance(cand, type) and issubclass(cand, ConfigBase):
            out[f.name] = (cand, optional)
    return out


def build_config(cls: type[C], data: Any, where: str) -> C:
    """Dataclass ``cls`` from a nested mapping, refusing unknown keys.

    Args:
        cls: a config dataclass (fields annotated with a :class:`ConfigBase` dataclass are
            built from nested mappings).
        data: the mapping.
        where: how errors name it (``"model"``, ``"UniCacheConfig.head_merge"``; ``""``: the
            root of a run config, "the config").
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    complete = getattr(cls, "complete_mapping", None)
    if complete is not None:
        data = complete(dict(data))
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown field(s) {unknown} in {where or 'the config'}; known: {sorted(known)}"
        )
    subs = _subconfigs(cls)
    kwargs = {}
    for name, value in data.items():
        sub, _ = subs.get(name, (None, False))
        if sub is not None and isinstance(value, dict):
            value = build_config(sub, value, f"{where}.{name}".strip("."))
        kwargs[name] = value
    return cls(**kwargs)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``, recursing into nested mappings."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
