"""Fine-tune a local HF checkpoint, optionally as mHC, optionally with KV compression in the loop.

    python recipes/finetune_hf.py --checkpoint_dir DIR [--config X.yaml] [hf.mhc=true ...]
    fabric run --accelerator cpu --devices 2 --strategy ddp recipes/finetune_hf.py \\
        --checkpoint_dir DIR

Steps: :func:`~unicache_train.checkpoint.hf.import_hf` (config + weights; tokenizer from the
directory when it has one) -> optional :func:`~unicache_train.model.convert.convert_to_mhc`
(identity init, same function as the source) -> the imported weights are written to
``<out_dir>/init_weights.safetensors`` and loaded by the LightningModule through
``TrainConfig.init_weights`` -> :func:`unicache_train.train.run.fit` -> optional HF export.
Every rank runs the same deterministic steps (seeded conversion), so a multi-process launch
needs no coordination beyond an atomic file rename.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from unicache_train.checkpoint.hf import export_hf
from unicache_train.config import ConfigError, RunConfig, apply_overrides, load_yaml
from unicache_train.train.from_hf import prepare_hf_run

DEFAULT_YAML = Path(__file__).with_suffix(".yaml")
HF_DEFAULTS: dict[str, Any] = {
    "checkpoint_dir": None, "mhc": False, "hc_mult": 4, "hc_preset": "deepseek_v4", "seed": 0,
    "export_dir": None, "export_family": None, "export_dtype": "bf16",
}


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """argv -> (the ``hf`` section, the rest of the run config as a dict)."""
    args = list(argv)
    path = DEFAULT_YAML
    for flag in ("--config", "--checkpoint_dir"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                raise ConfigError(f"{flag} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            if flag == "--config":
                path = Path(value)
            else:
                args.append(f"hf.checkpoint_dir={value}")
    data = load_yaml(Path(path).read_text()) or {}
    apply_overrides(data, args)
    hf = {**HF_DEFAULTS, **(data.pop("hf", None) or {})}
    unknown = sorted(set(hf) - set(HF_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} in hf; known: {sorted(HF_DEFAULTS)}")
    if not hf["checkpoint_dir"]:
        raise ConfigError("hf.checkpoint_dir is not set: pass --checkpoint_dir DIR")
    data.pop("model", None)  # the architecture comes from the checkpoint
    return hf, data


def build(hf: dict[str, Any], data: dict[str, Any]) -> RunConfig:
    """Import (and convert) the checkpoint, write the init weights, return the run config."""
    return prepare_hf_run(
        hf["checkpoint_dir"], data, mhc=bool(hf["mhc"]), hc_mult=int(hf["hc_mult"]),
        hc_preset=hf["hc_preset"], seed=int(hf["seed"]),
    )  # fmt: skip


def main(argv: list[str] | None = None):
    from unicache_train.train.run import fit

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        raise SystemExit(0)
    hf, data = parse(args)
    config = build(hf, data)
    trainer = fit(config)
    if hf["export_dir"] and trainer.is_global_zero:
        family = hf["export_family"] or _source_family(Path(hf["checkpoint_dir"]))
        model = trainer.lightning_module.model.float().eval()
        export_hf(model, hf["export_dir"], family=family, dtype=hf["export_dtype"])
    return trainer


def _source_family(path: Path) -> str:
    import json

    return json.loads((path / "config.json").read_text())["model_type"]


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(main)
