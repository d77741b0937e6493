"""What the scripts under ``recipes/`` share: one command line, the results CSV, and the stages of
the fine-tune-from-a-base recipes. Recipes import this module and never each other.

Every recipe takes the same arguments::

    python recipes/NAME.py [--config FILE.yaml] [FLAG VALUE ...] [section.field=value ...]
    fabric run --accelerator cpu --devices 2 --strategy ddp recipes/NAME.py [...]

* ``--config FILE.yaml`` replaces the recipe's default YAML;
* ``section.field=value`` overrides are applied to the loaded YAML (values read as YAML scalars:
  :func:`~unicache_train.validation.apply_overrides`, the same as ``RunConfig.load``);
* ``FLAG VALUE`` is a recipe's short spelling of one override (``--checkpoint X`` is
  ``recipe.base_checkpoint=X``);
* ``-h`` / ``--help`` prints the recipe's docstring and every field of its sections, with the
  value the recipe would run with.

The recipe then builds its typed configs from the resulting mapping, one section each
(:func:`parse_recipe_args`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unicache_train.train.config import RunConfig, deep_merge, pop_config_path
from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    apply_overrides,
    build_config,
    check_int,
    load_yaml_file,
)

__all__ = [
    "parse_recipe_args",
    "recipe_help",
    "run_sections",
    "build_section",
    "run_recipe",
    "command_line",
    "results_header",
    "write_results_csv",
    "FinetuneOptions",
    "parse_finetune_args",
    "pretrain_base",
    "evaluate_stage",
]

#: A section of a recipe's config: a config dataclass (its fields are listed by ``--help``) or a
#: one-line description (a mapping the recipe reads itself, e.g. overrides of another config).
Section = type | str


# --------------------------------------------------------------------------------- command line
def run_sections(config_cls: type = RunConfig, exclude: Sequence[str] = ()) -> dict[str, Section]:
    """The sections of a run config dataclass (``model``, ``data``, ``train``, ...) and their
    types, for :func:`parse_recipe_args`."""
    import typing

    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls) if f.name not in exclude}


def parse_recipe_args(
    argv: Sequence[str],
    default_yaml: str | Path,
    sections: Mapping[str, Section],
    *,
    doc: str | None,
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A recipe's command line -> its config as one nested mapping (see the module docstring).

    Args:
        argv: the arguments after the script name.
        default_yaml: the YAML read when ``--config`` is absent.
        sections: the top-level sections allowed, in ``--help`` order.
        doc: the recipe's docstring, printed first by ``--help``.
        flags: short spellings, ``{"--checkpoint": "recipe.base_checkpoint"}``.
        defaults: values the recipe sets in code, under the YAML's (e.g. a path next to the
            recipe file).

    Returns:
        ``defaults``, the YAML merged on top, then the overrides applied.

    Raises:
        SystemExit: after printing the help (``-h`` / ``--help``).
        ConfigError: a malformed argument or an unknown section, named.
        FileNotFoundError: the YAML does not exist.
    """
    args = list(argv)
    flags = dict(flags or {})
    if any(a in ("-h", "--help") for a in args):
        print(recipe_help(doc, default_yaml, sections, flags, defaults))
        raise SystemExit(0)
    path, rest = pop_config_path(args, default_yaml)
    overrides = _expand_flags(rest, flags)
    data = deep_merge(dict(defaults or {}), _read_mapping(path))
    apply_overrides(data, overrides)
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known: {sorted(sections)}")
    return data


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    data = load_yaml_file(path) or {}  # safe: tags refused, errors name the file and line
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _expand_flags(args: list[str], flags: dict[str, str]) -> list[str]:
    """``--flag VALUE`` / ``--flag=VALUE`` -> ``target=VALUE``; every other argument must be an
    override (``section.field=value``)."""
    out = []
    i = 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        if key in flags:
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{key} needs a value ({key} VALUE)")
                value = args[i + 1]
                i += 1
            out.append(f"{flags[key]}={value}")
        elif key.startswith("-") and not eq:
            known = ["--config", *flags, "-h", "--help"]
            raise ConfigError(f"unknown flag {key!r}; known: {known} and section.field=value")
        else:
            out.append(args[i])
        i += 1
    return out


def recipe_help(
    doc: str | None,
    default_yaml: str | Path,
    sections: Mapping[str, Section],
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The ``--help`` text: the docstring, the usage line, the flags, then every field of every
    section with the value it has in the default YAML (else the dataclass default)."""
    path = Path(default_yaml)
    script = f"recipes/{path.stem}.py" if path.parent.name == "recipes" else "RECIPE.py"
    given = deep_merge(dict(defaults or {}), _read_mapping(path) if path.is_file() else {})
    metavars = {f: t.rpartition(".")[2].upper() for f, t in (flags or {}).items()}
    lines = [
        (doc or "").strip(),
        "",
        f"usage: [python | fabric run ...] {script} [--config FILE.yaml]"
        + "".join(f" [{f} {m}]" for f, m in metavars.items())
        + " [section.field=value ...]",
        "",
        f"  --config FILE.yaml   replaces the default config, {_shown(path)}",
    ]
    lines += [f"  {f} {m}   = {flags[f]}={m}" for f, m in metavars.items()]
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
    import typing

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints.get(f.name)
        value = given.get(f.name, _default(f))
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            sub = value if isinstance(value, dict) else {}
            out += _field_lines(f"{prefix}.{f.name}", hint, sub)
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        out.append(f"  {prefix}.{f.name}: {f.type} = {_flow(value)}")
    return out


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
    """Config dataclass ``cls`` from the section ``name`` of a recipe's mapping (popped).

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


def run_recipe(default_yaml: str | Path, argv: Sequence[str] | None = None, doc: str | None = None):
    """A recipe that is one training run (``recipes/pretrain_tiny.py``): its YAML, ``--config``
    and overrides -> :func:`unicache_train.train.run.fit`. The launcher's flags (``fabric run
    --devices 2 --strategy ddp``) arrive through the environment and are applied in ``fit``.

    Returns:
        The finished Trainer.
    """
    from unicache_train.train.run import fit

    args = list(sys.argv[1:] if argv is None else argv)
    data = parse_recipe_args(args, default_yaml, run_sections(), doc=doc)
    return fit(RunConfig.from_dict(data))


# --------------------------------------------------------------------------------- results CSV
def command_line(recipe: str, args: Sequence[str]) -> str:
    """The shell command that runs ``recipes/<recipe>.py`` with ``args`` (``OMP_NUM_THREADS``
    included when set: it changes the wall times on a shared CPU)."""
    omp = os.environ.get("OMP_NUM_THREADS")
    return ((f"OMP_NUM_THREADS={omp} " if omp else "") + f"python recipes/{recipe}.py " +
            shlex.join(args)).rstrip()  # fmt: skip


def results_header(command: str, seconds: float) -> list[str]:
    """The two comment lines that lead a results CSV under ``experiments/*/results/``: the command,
    then the machine, torch version and wall time, so that a copy says how it was made."""
    import torch

    machine = platform.processor() or platform.machine()
    return [command, f"{machine}, torch {torch.__version__}, {seconds:.0f}s"]


def write_results_csv(
    path: str | Path, rows: Sequence[dict[str, Any]], command: str, seconds: float
) -> Path:
    """``rows`` as CSV plus a ``wall_s_total`` column, led by :func:`results_header`."""
    from unicache_train.eval.report import write_csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**r, "wall_s_total": f"{seconds:.0f}"} for r in rows]
    return write_csv(path, rows, list(rows[0]), header=results_header(command, seconds))


# --------------------------------------------------------------------------------- fine-tuning
@dataclass
class FinetuneOptions(ConfigBase):
    """The ``recipe`` section of the fine-tune-from-a-base recipes (``finetune_compress.py``,
    ``finetune_xkv.py``).

    Attributes:
        base_checkpoint: the model to fine-tune (``--checkpoint``); None pretrains one first.
        pretrain_config: YAML of that pretraining (:func:`parse_finetune_args` defaults it to
            ``recipes/pretrain_tiny.yaml``).
        pretrain: overrides of it, the top-level ``pretrain`` section
            (``pretrain.train.max_steps=200``).
        num_recall: recall prompts decoded per evaluation.
        limit_batches: validation batches for perplexity and KL per evaluation.
        recall_seed: seed of the evaluation's recall prompts.
    """

    base_checkpoint: str | None = None
    pretrain_config: str | None = None
    pretrain: dict[str, Any] = field(default_factory=dict)
    num_recall: int = 100
    limit_batches: int = 8
    recall_seed: int = 9_999

    def __post_init__(self) -> None:
        value = self.base_checkpoint
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(
                f"{type(self).__name__}.base_checkpoint={value!r}: expected None or a path"
            )
        if not isinstance(self.pretrain, dict):
            raise ConfigError(
                f"{type(self).__name__}.pretrain={self.pretrain!r}: expected a mapping of "
                "section.field overrides"
            )
        check_int(self, "num_recall", 0)
        check_int(self, "limit_batches", 1)
        check_int(self, "recall_seed", 0)


def parse_finetune_args(
    argv: Sequence[str],
    default_yaml: str | Path,
    doc: str | None,
    options_cls: type[FinetuneOptions] = FinetuneOptions,
) -> tuple[Any, RunConfig]:
    """The command line of a fine-tune-from-a-base recipe -> (its ``recipe`` section, the
    fine-tune's :class:`RunConfig`).

    Sections: ``recipe`` (``options_cls``; ``--checkpoint PATH`` is
    ``recipe.base_checkpoint=PATH``), ``pretrain`` (overrides of the base pretraining, whose YAML
    defaults to ``pretrain_tiny.yaml`` beside ``default_yaml``), and the run config's.
    """
    sections = {
        "recipe": options_cls,
        "pretrain": "overrides of recipe.pretrain_config (pretrain.train.max_steps=200)",
        **run_sections(),
    }
    pretrain_yaml = Path(default_yaml).parent / "pretrain_tiny.yaml"
    data = parse_recipe_args(
        argv,
        default_yaml,
        sections,
        doc=doc,
        flags={"--checkpoint": "recipe.base_checkpoint"},
        defaults={"recipe": {"pretrain_config": str(pretrain_yaml)}},
    )
    options = build_section(options_cls, data, "recipe", lifted=("pretrain",))
    return options, RunConfig.from_dict(data)


def pretrain_base(options: FinetuneOptions, ft: RunConfig) -> Path:
    """Pretrain (or finish pretraining) the base under ``<ft out_dir>/pretrain`` with the
    fine-tune's logger, accelerator and progress bar; returns its ``last.ckpt``."""
    from unicache_train.train.run import fit

    if options.pretrain_config is None:
        raise ConfigError("recipe.pretrain_config is not set: give a YAML or --checkpoint")
    path = Path(options.pretrain_config)
    out = Path(ft.train.out_dir) / "pretrain"
    forced = {
        "train": {
            "out_dir": str(out),
            "resume": "auto",
            "accelerator": ft.train.accelerator,
            "progress_bar": ft.train.progress_bar,
        },
        "logging": {"logger": ft.logging.logger},
    }
    data = deep_merge(deep_merge(_read_mapping(path), forced), options.pretrain)
    fit(RunConfig.from_dict(data))
    return out / "checkpoints" / "last.ckpt"


def evaluate_stage(
    model, config: RunConfig, tokenizer, loader, options: FinetuneOptions, name: str, **kw: Any
) -> list[dict[str, Any]]:
    """One model under the run's compression settings; CSV/PNG under ``<out_dir>/eval``.

    Args:
        config: the fine-tune config: its ``compress.unicache`` (rates default to its
            ``target_rate``), ``compress.xkv`` (minus the per-row rank mode and reduction), split
            seed and minimal context, data and batch size.
        kw: other :class:`~unicache_train.eval.sweep.CompressionEvalConfig` fields
            (``rates``, ``xkv_reductions``, ``match_unicache``).

    Returns:
        The rows of :func:`~unicache_train.eval.sweep.evaluate_compression` (uncompressed
        first).
    """
    from unicache_train.eval.report import write_outputs
    from unicache_train.eval.sweep import CompressionEvalConfig, evaluate_compression

    uc = config.compress.unicache
    per_row = ("rank_mode", "reduction")
    xkv = {k: v for k, v in config.compress.xkv.to_dict().items() if k not in per_row}
    kw.setdefault("rates", [uc.target_rate])
    eval_cfg = CompressionEvalConfig(
        quantize="config",
        num_recall=options.num_recall,
        recall_seed=options.recall_seed,
        limit_batches=options.limit_batches,
        batch_size=config.data.batch_size,
        split_seed=config.compress.seed,
        min_context=config.compress.min_context,
        out_dir=str(Path(config.train.out_dir) / "eval"),
        name=name,
        xkv=xkv,
        **kw,
    )
    rows = evaluate_compression(model, tokenizer, config.data, uc, eval_cfg, loader=loader)
    write_outputs(rows, eval_cfg.out_dir, name)
    return rows
