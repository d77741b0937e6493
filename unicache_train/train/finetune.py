"""The library's one fine-tune entry point: a checkpoint, a data mix, compression, steps, a seed
and an output folder in, the run's paths out.

    spec = FinetuneSpec.from_dict({
        "checkpoint": "smollm2", "out_dir": "runs/ft/control_seed0", "seed": 0, "steps": 60,
        "mix": {"kind": "long_context", "families": ["niah_single"], "length": 512,
                "records": 40, "seed": 21},
        "compress": {"enabled": True, "method": "none"},
        "run": {"data": {"seq_len": 640, "batch_size": 2, "split_at": "question"},
                "train": {"lr": 3.0e-5}},
    })
    result = finetune(spec)        # result.export_dir, result.checkpoint, result.run_json ...

The spec is the whole config: every value the run uses is in it or is a documented default of
:class:`~unicache_train.train.config.RunConfig`; nothing comes from a recipe's YAML. The values
that the spec's own fields set (``data.source``, ``train.out_dir``, ``train.max_steps``,
``train.seed``, ``data.seed``) are refused inside ``run``, so each lives in one place. A study
freezes a spec (or the fields it builds one from) in its ``study.yaml``; the resolved spec is
written to ``<out_dir>/finetune.yaml`` before the run starts, and ``run.json`` after it: the
paths, the steps taken, the seconds and the code revision
(:func:`unicache_train.revision.current_revision`).

Stages: the mix is written (``<out_dir>/train_mix.jsonl``, atomically; or a given file is used)
-> :func:`~unicache_train.train.from_hf.prepare_hf_run` (import, optional mHC retrofit, init
weights) -> :func:`~unicache_train.train.run.fit` -> on rank zero, an HF export with the policy
the model was tuned for (``compression_config.json``) and, for the attention-scorer selection,
the scorer file beside the weights.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_range,
)

__all__ = ["FinetuneResult", "FinetuneSpec", "MixConfig", "finetune", "run_config_of"]

MIX_KINDS = ("file", "synthetic", "recall", "long_context")

#: Fields of the run mapping that the spec's own fields set (refused in ``run``).
_OWNED = {
    ("data", "source"): "mix",
    ("train", "out_dir"): "out_dir",
    ("train", "max_steps"): "steps",
    ("train", "seed"): "seed",
    ("data", "seed"): "data_seed",
}


@dataclass
class MixConfig(ConfigBase):
    """The training data: a prepared file, or records generated from training seeds.

    Attributes:
        kind: ``file`` (``path``, a JSONL or text file the datamodule reads), ``synthetic``
            (the bundled synthetic corpus, set by ``run.data.synthetic``), ``recall``
            (key-value recall records + real text passages,
            :func:`~unicache_train.data.recall_mix.write_recall_mix`)
            or ``long_context`` (RULER-style records on the training haystack,
            :func:`~unicache_train.data.long_context.long_context_records`).
        path: the file (``kind: file``).
        seed: the records' training seed (below the evaluation seeds; required unless ``file``).
        records: records per recall task or per long-context family (>= 1 unless ``file``).
        tasks: ``recall``: :class:`~unicache_train.eval.RecallTask` mappings; ``long_context``:
            family names (``niah_single``, ...).
        length: ``long_context``: context tokens per record.
        text_fraction: ``recall``: share of real-text passages among all rows, in [0, 1).
    """

    config_path = "FinetuneSpec.mix"

    kind: str = "file"
    path: str | None = None
    seed: int | None = None
    records: int = 0
    tasks: list[Any] = field(default_factory=list)
    length: int = 0
    text_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_choice(self, "kind", MIX_KINDS)
        where = f"FinetuneSpec.mix (kind {self.kind!r})"
        if self.kind == "file":
            if not self.path:
                raise ConfigError(f"{where}: set mix.path to the training JSONL")
            return
        if self.kind == "synthetic":
            return
        if self.seed is None:
            raise ConfigError(f"{where}: set mix.seed (a training seed) for generated records")
        check_int(self, "seed", 0)
        check_int(self, "records", 1)
        if not self.tasks:
            raise ConfigError(f"{where}: mix.tasks is empty; give the tasks or families")
        if self.kind == "long_context":
            check_int(self, "length", 16)
        else:
            check_range(self, "text_fraction", 0.0, 1.0, hi_open=True)


@dataclass
class FinetuneSpec(ConfigBase):
    """Everything a fine-tune does (see the module docstring).

    Attributes:
        checkpoint: a checkpoint known to :func:`unicache_train.checkpoint.gguf.fetch`
            (``smollm2``, fetched into the cache if needed) or a local HF checkpoint directory.
        out_dir: the run's folder (checkpoints, logs, ``export/``, ``run.json``).
        seed: the run's seed (``train.seed``: initialisation of anything new, dropout, in-loop
            random splits) and, unless ``data_seed`` is given, the data order. The mix and the
            compressor have their own (``mix.seed``, ``compress.seed``).
        data_seed: the data order and the train/val split (``data.seed``); None: ``seed``. A
            fine-tune with no dropout, no new weights and nothing random in the loop (the
            control) is a function of this seed alone: two seeds that share it train the same
            weights.
        steps: optimizer steps (``train.max_steps``, >= 1).
        mix: the training data (:class:`MixConfig`).
        compress: the in-loop compression, a
            :class:`~unicache_train.train.config.CompressionTrainConfig` mapping (``{"enabled":
            true, "method": "none"}``: the control, same splits and loss, nothing compressed).
        run: the other :class:`~unicache_train.train.config.RunConfig` sections (``data``,
            ``train``, ``logging``, ``monitor``); its ``model`` is the checkpoint's.
        mhc, hc_mult, hc_preset: retrofit mHC before training (identity init).
        hc_seed: seed of the retrofit's symmetry breakers (None: ``seed``).
        export: write an HF export at the end.
        export_dir: where (None: ``<out_dir>/export``).
        export_family: HF family of the export (default: the checkpoint's ``model_type``).
        export_dtype: ``bf16``, ``fp32`` or None (the trained model's, fp32).
    """

    config_path = "FinetuneSpec"

    checkpoint: str = ""
    out_dir: str = ""
    seed: int = 0
    data_seed: int | None = None
    steps: int = 0
    mix: MixConfig | None = None
    compress: dict[str, Any] = field(default_factory=lambda: {"enabled": False})
    run: dict[str, Any] = field(default_factory=dict)
    mhc: bool = False
    hc_mult: int = 4
    hc_preset: str = "deepseek_v4"
    hc_seed: int | None = None
    export: bool = True
    export_dir: str | None = None
    export_family: str | None = None
    export_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mix, dict):
            self.mix = MixConfig.from_dict(self.mix)
        if self.mix is None:
            raise ConfigError(
                "FinetuneSpec.mix is not set: the training data (kind file|recall|long_context)"
            )
        if not self.checkpoint:
            raise ConfigError("FinetuneSpec.checkpoint is not set: a known name or a directory")
        if not self.out_dir:
            raise ConfigError("FinetuneSpec.out_dir is not set")
        check_int(self, "seed", 0)
        if self.data_seed is not None:
            check_int(self, "data_seed", 0)
        check_int(self, "steps", 1)
        check_bool(self, "mhc")
        check_bool(self, "export")
        check_int(self, "hc_mult", 1)
        if self.hc_seed is not None:
            check_int(self, "hc_seed", 0)
        if self.export_dtype is not None:
            check_choice(self, "export_dtype", ("bf16", "fp32"))
        if not isinstance(self.compress, dict):
            raise ConfigError(
                f"FinetuneSpec.compress={self.compress!r}: expected a mapping "
                "(CompressionTrainConfig fields)"
            )
        if not isinstance(self.run, dict):
            raise ConfigError(f"FinetuneSpec.run={self.run!r}: expected a mapping of sections")
        if "compress" in self.run:
            raise ConfigError(
                "FinetuneSpec.run.compress: give compression as FinetuneSpec.compress"
            )
        for (section, name), owner in _OWNED.items():
            if name in (self.run.get(section) or {}):
                raise ConfigError(
                    f"FinetuneSpec.run.{section}.{name} is set by FinetuneSpec.{owner}; "
                    f"remove it from run"
                )


@dataclass
class FinetuneResult:
    """What :func:`finetune` returns: the run's paths (and the trainer, for in-process use)."""

    out_dir: Path
    checkpoint: Path  # <out_dir>/checkpoints/last.ckpt
    config: Path  # <out_dir>/config.yaml, the resolved RunConfig
    spec: Path  # <out_dir>/finetune.yaml, the spec
    run_json: Path  # <out_dir>/run.json
    mix: Path
    export_dir: Path | None
    steps: int
    seconds: float
    trainer: Any = field(default=None, repr=False)


def _checkpoint_dir(name: str) -> Path:
    from unicache_train.checkpoint.gguf import KNOWN, fetch

    return fetch(name) if name in KNOWN else Path(name)


def write_mix(mix: MixConfig, out_dir: Path, checkpoint_dir: Path) -> Path:
    """The ``data.source`` of ``mix``: a generated JSONL (``<out_dir>/train_mix.jsonl``), the
    given file, or ``synthetic``."""
    if mix.kind == "synthetic":
        return Path("synthetic")  # data.source: the datamodule's bundled corpus
    if mix.kind == "file":
        path = Path(str(mix.path))
        if not path.is_file():
            raise ConfigError(f"FinetuneSpec.mix.path={str(path)!r}: no such file")
        return path
    target = out_dir / "train_mix.jsonl"
    if mix.kind == "recall":
        from unicache_train.data.recall_mix import write_recall_mix
        from unicache_train.eval import RecallTask

        tasks = [t if isinstance(t, RecallTask) else RecallTask(**t) for t in mix.tasks]
        return write_recall_mix(
            target, tasks, mix.records, seed=int(mix.seed or 0), text_fraction=mix.text_fraction
        )
    from unicache_train.data.long_context import (
        LongContextTask,
        long_context_records,
        write_long_context_mix,
    )
    from unicache_train.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(checkpoint_dir))
    records: list[dict] = []
    for family in mix.tasks:
        task = LongContextTask(family=str(family), tokens=mix.length)
        records += long_context_records(task, mix.records, int(mix.seed or 0), tok, split="train")
    return write_long_context_mix(target, records)


def run_mapping(spec: FinetuneSpec, mix_path: str | Path) -> dict[str, Any]:
    """The RunConfig mapping of ``spec`` (before the checkpoint's model section is added)."""
    run = copy.deepcopy(spec.run)
    data = run.setdefault("data", {})
    data["source"] = str(mix_path)
    data["seed"] = int(spec.seed if spec.data_seed is None else spec.data_seed)
    train = run.setdefault("train", {})
    train["out_dir"] = str(spec.out_dir)
    train["max_steps"] = int(spec.steps)
    train["seed"] = int(spec.seed)
    run["compress"] = copy.deepcopy(spec.compress)
    return run


def run_config_of(spec: FinetuneSpec, mix_path: str | Path, checkpoint_dir: str | Path):
    """The validated :class:`RunConfig` the fine-tune runs (imports the checkpoint and writes
    ``<out_dir>/init_weights.safetensors``)."""
    from unicache_train.train.from_hf import prepare_hf_run

    return prepare_hf_run(
        checkpoint_dir,
        run_mapping(spec, mix_path),
        mhc=spec.mhc,
        hc_mult=spec.hc_mult,
        hc_preset=spec.hc_preset,
        seed=spec.seed if spec.hc_seed is None else spec.hc_seed,
    )


def _family(checkpoint_dir: Path) -> str:
    from unicache_train.checkpoint.hf_config import from_hf_config

    return from_hf_config(json.loads((checkpoint_dir / "config.json").read_text()))[1]


def _write_json(path: Path, record: dict[str, Any]) -> None:
    from unicache_train.checkpoint.zero import atomic_write

    text = json.dumps(record, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))


def finetune(spec: FinetuneSpec | dict[str, Any]) -> FinetuneResult:
    """Run ``spec``; return its paths.

    Every rank of a distributed launch calls this with the same spec; the mix and the init
    weights are written atomically (each rank writes the same bytes), the export and
    ``run.json`` by rank zero only. What a caller may do after it returns is what
    :func:`unicache_train.train.run.fit` states.
    """
    from unicache_train.revision import current_revision
    from unicache_train.train.run import fit

    if isinstance(spec, dict):
        spec = FinetuneSpec.from_dict(spec)
    t0 = time.time()
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = _checkpoint_dir(spec.checkpoint)
    spec.save(out / "finetune.yaml")
    mix = write_mix(spec.mix, out, ckpt)
    config = run_config_of(spec, mix, ckpt)
    trainer = fit(config)
    export_dir = None
    if trainer.is_global_zero:
        if spec.export:
            target = Path(spec.export_dir) if spec.export_dir else out / "export"
            export_dir = _export(trainer, config, spec, ckpt, target)
        seconds = time.time() - t0
        _write_json(
            out / "run.json",
            {
                "spec": str(out / "finetune.yaml"),
                "config": str(out / "config.yaml"),
                "checkpoint": str(out / "checkpoints" / "last.ckpt"),
                "export": None if export_dir is None else str(export_dir),
                "mix": str(mix),
                "steps": int(trainer.global_step),
                "seconds": round(seconds, 1),
                "revision": current_revision(),
            },
        )
    return FinetuneResult(
        out_dir=out,
        checkpoint=out / "checkpoints" / "last.ckpt",
        config=out / "config.yaml",
        spec=out / "finetune.yaml",
        run_json=out / "run.json",
        mix=Path(mix),
        export_dir=export_dir,
        steps=int(trainer.global_step),
        seconds=time.time() - t0,
        trainer=trainer,
    )


def _export(trainer, config, spec: FinetuneSpec, ckpt: Path, target: Path) -> Path:
    from unicache_train.checkpoint.hf import export_hf
    from unicache_train.checkpoint.policy import policy_of

    model = trainer.lightning_module.model.float().eval()
    scorer = None
    if config.compress.attention_scorer:
        # the scorer is fitted before the fine-tune and frozen in it: it travels as fitted
        from unicache_train.compress.attention_scorer import read_attention_scorer

        c = model.config
        scorer = read_attention_scorer(
            config.compress.attention_scorer,
            (c.num_hidden_layers, c.num_key_value_heads, c.head_size),
        )
    export_hf(
        model,
        target,
        family=spec.export_family or _family(ckpt),
        dtype=spec.export_dtype,
        compression_policy=policy_of(config.compress),
        tokenizer_from=config.data.tokenizer,
        attention_scorer=scorer,
    )
    return target
