"""The one command-line grammar of ``unicache-train`` and of the recipes under ``recipes/``::

    unicache-train COMMAND [--config FILE.yaml] [--OPTION VALUE ...] [section.field=value ...]
    python recipes/NAME.py [--config FILE.yaml] [--OPTION VALUE ...] [section.field=value ...]

* ``--config FILE.yaml`` replaces the default config (a recipe's YAML; none for a command);
* ``section.field=value`` overrides are applied to the loaded mapping, values read as YAML scalars
  (:func:`~unicache_train.validation.apply_overrides`, the same as ``RunConfig.load``);
* ``--OPTION VALUE`` is the one spelling of a field that has no YAML of its own (a command's
  options: ``--checkpoint X`` is ``evaluate.checkpoint=X``) or a recipe's short spelling of one
  override (``--checkpoint X`` is ``recipe.base_checkpoint=X``); a boolean option is given bare
  (``--compressed``) or with a value (``--compressed false``, ``--compressed=false``);
* ``-h`` / ``--help`` prints the docstring, the options and every field of every section with the
  value the run would use.

The caller then builds its typed configs from the mapping, one section each
(:func:`build_section`). Imports nothing heavier than PyYAML and our config helpers.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from unicache_train.validation import (
    ConfigError,
    apply_overrides,
    build_config,
    deep_merge,
    load_yaml_file,
)

__all__ = [
    "Section",
    "config_sections",
    "parse_args",
    "help_text",
    "build_section",
    "read_config_file",
    "pop_config_path",
]

#: A section of a config: a config dataclass (its fields are listed by ``--help``) or a one-line
#: description (a mapping the caller reads itself, e.g. overrides of another config).
Section = type | str


def pop_config_path(args: list[str], default: str | Path | None) -> tuple[Path | None, list[str]]:
    """Split ``--config FILE.yaml`` (or ``--config=FILE.yaml``) off command-line arguments.

    Returns:
        (the YAML path, ``default`` when the flag is absent; the other arguments).
    """
    rest = list(args)
    path = None if default is None else Path(default)
    for i, arg in enumerate(rest):
        key, eq, value = arg.partition("=")
        if key != "--config":
            continue
        if eq:
            del rest[i]
            return Path(value), rest
        if i + 1 >= len(rest):
            raise ConfigError("--config needs a YAML path")
        path = Path(rest[i + 1])
        del rest[i : i + 2]
        break
    return path, rest


def config_sections(config_cls: type, exclude: Sequence[str] = ()) -> dict[str, Section]:
    """The sections of a config dataclass (``model``, ``data``, ``train``, ...) and their types,
    for :func:`parse_args`."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls) if f.name not in exclude}


def parse_args(
    argv: Sequence[str],
    sections: Mapping[str, Section],
    *,
    doc: str | None,
    usage: str,
    default_yaml: str | Path | None = None,
    flags: Mapping[str, str] | None = None,
    bool_flags: Sequence[str] = (),
    text_flags: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A command line -> the config as one nested mapping (see the module docstring).

    Args:
        argv: the arguments after the command (or the script name).
        sections: the top-level sections allowed, in ``--help`` order.
        doc: the docstring, printed first by ``--help``.
        usage: what ``--help`` names the program (``unicache-train fit``, ``recipes/x.py``).
        default_yaml: the YAML read when ``--config`` is absent (None: start from nothing).
        flags: options, ``{"--checkpoint": "evaluate.checkpoint"}``.
        bool_flags: the options among ``flags`` that take no value (given bare: true).
        text_flags: the options among ``flags`` whose value is kept as written (a prompt: not
            read as YAML, so ``"null"``, ``"1e3"`` and trailing spaces stay text).
        defaults: values set in code, under the YAML's (e.g. a path next to the recipe file).

    Returns:
        ``defaults``, the YAML merged on top, then the options and overrides applied.

    Raises:
        SystemExit: after printing the help (``-h`` / ``--help``).
        ConfigError: a malformed argument, an unknown option or section, named.
        FileNotFoundError: the YAML does not exist.
    """
    args = list(argv)
    flags = dict(flags or {})
    if any(a in ("-h", "--help") for a in args):
        print(help_text(doc, usage, default_yaml, sections, flags, bool_flags, defaults))
        raise SystemExit(0)
    path, rest = pop_config_path(args, default_yaml)
    overrides = _expand_flags(rest, flags, set(bool_flags))
    texts = {flags[f] for f in text_flags}
    data = deep_merge(dict(defaults or {}), read_config_file(path) if path is not None else {})
    apply_overrides(data, [o for o in overrides if o.partition("=")[0] not in texts])
    for item in overrides:
        target, _, value = item.partition("=")
        if target in texts:
            *parents, leaf = target.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known: {sorted(sections)}")
    return data


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    data = load_yaml_file(path) or {}  # safe: tags refused, errors name the file and line
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _expand_flags(args: list[str], flags: dict[str, str], bools: set[str]) -> list[str]:
    """``--flag VALUE`` / ``--flag=VALUE`` / a bare boolean ``--flag`` -> ``target=VALUE``; every
    other argument must be an override (``section.field=value``)."""
    out = []
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        if key in flags:
            if not eq and key in bools:
                # bare, or followed by an explicit true/false
                nxt = args[i + 1].lower() if i + 1 < len(args) else ""
                value = "true"
                if nxt in ("true", "false"):
                    value = nxt
                    i += 1
            elif not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{key} needs a value ({key} VALUE)")
                value = args[i + 1]
                i += 1
            out.append(f"{flags[key]}={value}")
        elif key.startswith("-"):
            known = ["--config", *flags, "-h", "--help"]
            raise ConfigError(f"unknown flag {key!r}; known: {known} and section.field=value")
        else:
            out.append(args[i])
        i += 1
    return out


def help_text(
    doc: str | None,
    usage: str,
    default_yaml: str | Path | None,
    sections: Mapping[str, Section],
    flags: Mapping[str, str] | None = None,
    bool_flags: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The ``--help`` text: the docstring, the usage line, the options, then every field of every
    section with the value it has in the default YAML (else the dataclass default)."""
    path = None if default_yaml is None else Path(default_yaml)
    from_file = read_config_file(path) if path is not None and path.is_file() else {}
    given = deep_merge(dict(defaults or {}), from_file)
    metavars = {
        f: "" if f in bool_flags else " " + t.rpartition(".")[2].upper()
        for f, t in (flags or {}).items()
    }
    lines = [
        (doc or "").strip(),
        "",
        f"usage: {usage} [--config FILE.yaml]"
        + "".join(f" [{f}{m}]" for f, m in metavars.items())
        + " [section.field=value ...]",
        "",
        "  --config FILE.yaml   "
        + (f"replaces the default config, {_shown(path)}" if path else "a config to start from"),
    ]
    lines += [f"  {f}{m}   = {flags[f]}={m.strip() or 'true'}" for f, m in metavars.items()]
    lines += ["", "fields (section.field=value; shown with the value this run would use):"]
    for name, section in sections.items():
        value = given.get(name)
        if isinstance(section, str):
            lines.append(f"  {name}.*   {section}")
            if isinstance(value, dict) and value:
                lines += _field_lines(name, None, value)
        elif dataclasses.is_dataclass(section):
            # A field filled from a top-level section of its name is listed there.
            lifted = set(sections) - {name}
            sub = value if isinstance(value, dict) else {}
            lines += _field_lines(name, section, sub, skip=lifted)
        else:
            lines.append(f"  {name} = {_flow(value)}")
    return "\n".join(lines)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _field_lines(
    prefix: str, cls: type | None, given: dict[str, Any], skip: set[str] | frozenset = frozenset()
) -> list[str]:
    """``prefix.field: type = value`` per field of ``cls`` (nested config dataclasses expanded);
    without a class, the keys of ``given``."""
    if cls is None:
        return [f"  {prefix}.{k} = {_flow(v)}" for k, v in given.items()]
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = _config_type(hints.get(f.name))
        value = given.get(f.name, _default(f))
        if hint is not None:
            sub = value if isinstance(value, dict) else {}
            out += _field_lines(f"{prefix}.{f.name}", hint, sub)
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        out.append(f"  {prefix}.{f.name}: {f.type} = {_flow(value)}")
    return out


def _config_type(hint: Any) -> type | None:
    """The config dataclass behind ``hint`` (``X`` or ``X | None``), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    cand = args[0] if len(args) == 1 else hint
    return cand if isinstance(cand, type) and dataclasses.is_dataclass(cand) else None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _flow(value: Any) -> str:
    """A value as one line of YAML (what an override would write)."""
    if isinstance(value, Path):
        value = str(value)
    return yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]


def build_section(cls: type, data: dict[str, Any], name: str, lifted: Sequence[str] = ()) -> Any:
    """Config dataclass ``cls`` from the section ``name`` of a parsed mapping (popped).

    Args:
        lifted: fields of ``cls`` filled from top-level sections of the same name (also popped;
            e.g. ``pretrain``: the overrides of the base pretraining, written
            ``pretrain.train.max_steps=200``), refused inside the section itself.
    """
    section = data.pop(name, None) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{name}: expected a mapping of fields, got {section!r}")
    for key in lifted:
        if key in section:
            raise ConfigError(f"{name}.{key}: write {key}.SECTION.FIELD=VALUE instead")
        value = data.pop(key, None) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of overrides, got {value!r}")
        section[key] = value
    return build_config(cls, section, name)
