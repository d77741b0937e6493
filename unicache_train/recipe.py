"""What the scripts under ``recipes/`` share: the command line, the results CSV, and the stages of
the fine-tune-from-a-base recipes. Recipes import this module and never each other.

Every recipe takes the arguments of every ``unicache-train`` command (one grammar, one parser:
:mod:`unicache_train.commandline`)::

    python recipes/NAME.py [--config FILE.yaml] [--OPTION VALUE ...] [section.field=value ...]
    fabric run --accelerator cpu --devices 2 --strategy ddp recipes/NAME.py [...]

``--config`` replaces the recipe's YAML; ``--OPTION VALUE`` is a recipe's short spelling of one
override (``--checkpoint X`` is ``recipe.base_checkpoint=X``); ``-h`` lists every field with the
value the recipe would run with. The recipe then builds its typed configs from the mapping, one
section each (:func:`build_section`).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicache_train.commandline import (
    Section,
    build_section,
    config_sections,
    help_text,
    parse_args,
    read_config_file,
)
from unicache_train.train.config import RunConfig
from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    check_int,
    deep_merge,
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
    "BaseStage",
    "base_stage",
    "evaluate_stage",
]


def _usage(default_yaml: str | Path) -> str:
    path = Path(default_yaml)
    name = f"recipes/{path.stem}.py" if path.parent.name == "recipes" else "RECIPE.py"
    return f"[python | fabric run ...] {name}"


def run_sections(config_cls: type = RunConfig, exclude: Sequence[str] = ()) -> dict[str, Section]:
    """The sections of a run config dataclass (``model``, ``data``, ``train``, ...)."""
    return config_sections(config_cls, exclude)


def parse_recipe_args(
    argv: Sequence[str],
    default_yaml: str | Path,
    sections: Mapping[str, Section],
    *,
    doc: str | None,
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A recipe's command line -> its config as one nested mapping
    (:func:`unicache_train.commandline.parse_args` with the recipe's YAML as the default)."""
    return parse_args(
        argv,
        sections,
        doc=doc,
        usage=_usage(default_yaml),
        default_yaml=default_yaml,
        flags=flags,
        defaults=defaults,
    )


def recipe_help(
    doc: str | None,
    default_yaml: str | Path,
    sections: Mapping[str, Section],
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """A recipe's ``--help`` text (:func:`unicache_train.commandline.help_text`)."""
    return help_text(doc, _usage(default_yaml), default_yaml, sections, flags, (), defaults)


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
    return (
        (f"OMP_NUM_THREADS={omp} " if omp else "")
        + f"python recipes/{recipe}.py "
        + shlex.join(args)
    ).rstrip()


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
    data = deep_merge(deep_merge(read_config_file(path), forced), options.pretrain)
    fit(RunConfig.from_dict(data))
    return out / "checkpoints" / "last.ckpt"


@dataclass
class BaseStage:
    """What the fine-tune recipes start from (:func:`base_stage`).

    Attributes:
        checkpoint: the base ``.ckpt``; model: its decoder; loader: the validation batches of
        the fine-tune's data; tokenizer: their tokenizer; rank0: this process is rank 0;
        times: wall seconds per stage so far (``pretrain``).
    """

    checkpoint: Path
    model: Any
    loader: Any
    tokenizer: Any
    rank0: bool
    times: dict[str, float]


def base_stage(options: FinetuneOptions, ft: RunConfig) -> BaseStage:
    """The fine-tune recipes' first stage: the base checkpoint (``--checkpoint``, else pretrained
    here), the fine-tune taking its architecture (``ft.model`` is replaced), and the validation
    data the before/after evaluations share.

    Raises:
        FileNotFoundError: the base checkpoint does not exist.
    """
    import time

    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.data.datamodule import LMDataModule

    t0 = time.perf_counter()
    ckpt = Path(options.base_checkpoint or pretrain_base(options, ft))
    times = {"pretrain": time.perf_counter() - t0}
    if not ckpt.is_file():
        raise FileNotFoundError(f"base checkpoint not found: {ckpt}")
    model, base_cfg = load_checkpoint(ckpt)
    ft.model = base_cfg.model  # the architecture is the base's
    dm = LMDataModule(ft.data)
    dm.setup("validate")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    return BaseStage(ckpt, model, dm.val_dataloader(), dm.tokenizer, rank0, times)


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
