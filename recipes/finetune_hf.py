"""Fine-tune a local HF checkpoint, optionally as mHC, optionally with KV compression in the loop.

    python recipes/finetune_hf.py --checkpoint_dir DIR [--config X.yaml] [hf.mhc=true ...]
    fabric run --accelerator cpu --devices 2 --strategy ddp recipes/finetune_hf.py \\
        --checkpoint_dir DIR

Steps: :func:`~unicache_train.checkpoint.hf.import_hf` (config + weights; tokenizer from the
directory when it has one) -> optional :func:`~unicache_train.model.convert.convert_to_mhc`
(identity init, same function as the source) -> the imported weights are written to
``<out_dir>/init_weights.safetensors`` and loaded by the LightningModule through
``TrainConfig.init_weights`` -> :func:`unicache_train.train.run.fit` -> optional HF export: the
library's fine-tune entry point, :func:`unicache_train.train.finetune.finetune`, with the spec
this recipe's sections describe (:func:`spec_of`).
Every rank runs the same deterministic steps (seeded conversion), so a multi-process launch
needs no coordination beyond an atomic file rename.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unicache_train.recipe import build_section, parse_recipe_args, run_sections
from unicache_train.validation import ConfigError

DEFAULT_YAML = Path(__file__).with_suffix(".yaml")


@dataclass
class HFOptions:
    """The ``hf`` section: the checkpoint and what to do with it.

    Attributes:
        checkpoint_dir: the local HF checkpoint directory (``--checkpoint_dir DIR``).
        mhc: swap the residual for mHC (:func:`~unicache_train.model.convert.convert_to_mhc`,
            identity init).
        hc_mult: residual streams when ``mhc`` is true.
        hc_preset: ``deepseek_v4`` (exportable to HF) or ``paper``.
        seed: seeds the conversion's symmetry breakers (the same on every rank).
        export_dir: write the fine-tuned model here (HF format) at the end; None: no export.
        export_family: HF family of the export (default: the source's).
        export_dtype: ``bf16`` or ``fp32``.
    """

    checkpoint_dir: str | None = None
    mhc: bool = False
    hc_mult: int = 4
    hc_preset: str = "deepseek_v4"
    seed: int = 0
    export_dir: str | None = None
    export_family: str | None = None
    export_dtype: str = "bf16"


SECTIONS = {
    "hf": HFOptions,
    "model": "ignored: the architecture is the checkpoint's",
    **run_sections(exclude=("model",)),
}


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """argv -> (the ``hf`` section, the rest of the run config as a dict)."""
    data = parse_recipe_args(
        argv, DEFAULT_YAML, SECTIONS, doc=__doc__, flags={"--checkpoint_dir": "hf.checkpoint_dir"}
    )
    hf = asdict(build_section(HFOptions, data, "hf"))
    if not hf["checkpoint_dir"]:
        raise ConfigError("hf.checkpoint_dir is not set: pass --checkpoint_dir DIR")
    data.pop("model", None)  # the architecture comes from the checkpoint
    return hf, data


def spec_of(hf: dict[str, Any], data: dict[str, Any]):
    """The library's :class:`~unicache_train.train.finetune.FinetuneSpec` of this recipe's
    sections: ``data.source`` is the mix (a prepared file), ``train.max_steps`` /
    ``train.seed`` / ``data.seed`` the spec's steps, seed and data seed, ``hf.seed`` the
    retrofit's seed, ``compress`` the spec's."""
    import copy

    from unicache_train.data.config import DataConfig
    from unicache_train.train.config import TrainConfig
    from unicache_train.train.finetune import FinetuneSpec

    run = copy.deepcopy(data)
    train = run.setdefault("train", {})
    data = run.setdefault("data", {})
    source = data.pop("source", None)
    data_seed = int(data.pop("seed", DataConfig().seed))  # the data order, as the recipe ran
    mix = (
        {"kind": "synthetic"} if source in (None, "synthetic") else {"kind": "file", "path": source}
    )
    defaults = TrainConfig()
    return FinetuneSpec.from_dict(
        {
            "checkpoint": str(hf["checkpoint_dir"]),
            "out_dir": str(train.pop("out_dir", defaults.out_dir)),
            "seed": int(train.pop("seed", defaults.seed)),
            "data_seed": data_seed,
            "steps": int(train.pop("max_steps", defaults.max_steps)),
            "mix": mix,
            "compress": run.pop("compress", None) or {"enabled": False},
            "run": run,
            "mhc": bool(hf["mhc"]),
            "hc_mult": int(hf["hc_mult"]),
            "hc_preset": hf["hc_preset"],
            "hc_seed": int(hf["seed"]),
            "export": bool(hf["export_dir"]),
            "export_dir": hf["export_dir"],
            "export_family": hf["export_family"],
            "export_dtype": hf["export_dtype"],
        }
    )


def main(argv: list[str] | None = None):
    from unicache_train.train.finetune import finetune

    args = list(sys.argv[1:] if argv is None else argv)
    hf, data = parse(args)
    return finetune(spec_of(hf, data)).trainer


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(main)
