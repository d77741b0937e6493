"""Convert a GQA decoder to MLA (TransMLA arXiv 2502.07864, MHA2MLA arXiv 2502.14837), measure
perplexity before and after a short healing fine-tune, and export a DeepseekV3 checkpoint.

    python recipes/convert_to_mla.py                                  # pretrain a tiny source
    python recipes/convert_to_mla.py convert.checkpoint=runs/pretrain_tiny/checkpoints/last.ckpt
    python recipes/convert_to_mla.py convert.heal_steps=50 run.train.max_steps=200

Overrides are ``section.field=value`` on this file's two sections: ``run`` (a
:class:`~unicache_train.train.config.RunConfig`: the source model and data; ``run.train`` drives the
pretraining of the tiny source when no checkpoint is given) and ``convert``
(:class:`ConvertConfig`). Single process, plain PyTorch loops: CPU-friendly by design.

Rows of the printed table (validation perplexity, ``convert.eval_batches`` batches):

* ``source``: the GQA model; ``source + heal`` (``convert.control``): the same model fine-tuned
  for the same steps on the same data, the fair reference for a healed model;
* ``mla svd``: converted, before healing; ``mla svd + heal``: after ``convert.heal_steps``;
* ``mla random`` / ``mla random + heal`` (``convert.random_baseline``): fresh MLA attention
  weights, every other weight kept: what the SVD init is worth.

Writes ``<convert.out_dir>/results.json`` (everything, with the per-layer conversion report) and
``<convert.out_dir>/convert_to_mla.csv`` (the table, led by the command line).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from unicache_train.eval.perplexity import evaluate_perplexity
from unicache_train.model import Decoder
from unicache_train.model.convert_mla import convert_to_mla_with_report, kv_elements_per_token
from unicache_train.recipe import (
    build_section,
    command_line,
    parse_recipe_args,
    results_header,
)
from unicache_train.train import loop
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError
from unicache_train.validation import check_choice as _choice
from unicache_train.validation import check_int as _int
from unicache_train.validation import check_range as _range


@dataclass
class ConvertConfig:
    """Conversion, healing and reporting knobs (``convert`` section)."""

    checkpoint: str | None = None  # our Lightning .ckpt; None: pretrain a tiny GQA source first
    kv_lora_rank: int = 16
    qk_rope_head_dim: int = 16
    weighting: str = "output"
    rotation: str = "mean"
    calib_batches: int = 4
    heal_steps: int = 150
    heal_lr: float = 1.0e-3
    heal_warmup_steps: int = 10
    eval_batches: int = 16
    control: bool = True
    random_baseline: bool = True
    export: bool = True
    out_dir: str = "runs/convert_to_mla"

    def __post_init__(self) -> None:
        _int(self, "kv_lora_rank", 1)
        _int(self, "qk_rope_head_dim", 2)
        _choice(self, "weighting", ("output", "none"))
        _choice(self, "rotation", ("mean", "drop"))
        _int(self, "calib_batches", 1)
        _int(self, "heal_steps", 0)
        _range(self, "heal_lr", 0, 10, lo_open=True)
        _int(self, "heal_warmup_steps", 0)
        _int(self, "eval_batches", 1)


@dataclass
class RecipeConfig:
    """The recipe's two sections: ``run`` (the source model and data) and ``convert``."""

    run: RunConfig = field(default_factory=RunConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> RecipeConfig:
        """``--config PATH`` and ``section.field=value`` overrides -> the config."""
        return cls.from_args(["--config", str(path), *(overrides or [])])

    @classmethod
    def from_args(cls, argv: list[str]) -> RecipeConfig:
        """The command line (:func:`unicache_train.recipe.parse_recipe_args`) -> the config."""
        sections = {"run": RunConfig, "convert": ConvertConfig}
        data = parse_recipe_args(argv, Path(__file__).with_suffix(".yaml"), sections, doc=__doc__)
        return cls(
            run=RunConfig.from_dict(data.get("run") or {}),
            convert=build_section(ConvertConfig, data, "convert"),
        )


# ---------------------------------------------------------------------------- training
def train_steps(
    model: Decoder, loader_fn, steps: int, lr: float, warmup: int, run: RunConfig
) -> list[float]:
    """AdamW + warmup/cosine, the LightningModule's settings, as a plain loop. Returns losses."""
    return loop.train_steps(model, loop.endless(loader_fn), steps, lr, warmup, run.train).losses


# ---------------------------------------------------------------------------- the recipe
def main(cfg: RecipeConfig, command: str | None = None) -> dict[str, Any]:
    """Run the recipe; writes ``results.json`` and ``convert_to_mla.csv`` (led by ``command``,
    the command line that ran it) to ``convert.out_dir``."""
    from unicache_train.data.datamodule import LMDataModule

    cc, run = cfg.convert, cfg.run
    torch.manual_seed(run.train.seed)
    t0 = time.time()
    if cc.checkpoint:
        from unicache_train.checkpoint import load_checkpoint

        source, ckpt_run = load_checkpoint(cc.checkpoint)
        run = RunConfig(
            model=ckpt_run.model, data=ckpt_run.data, train=run.train, logging=run.logging
        )
        print(f"loaded {cc.checkpoint} (its data config is used: same tokenizer)")
    else:
        source = Decoder(run.model)
    data = LMDataModule(run.data)
    data.setup()
    if data.vocab_size > source.config.vocab_size:
        raise ConfigError(
            f"tokenizer vocab {data.vocab_size} > model vocab_size {source.config.vocab_size}"
        )
    train_fn, val = data.train_dataloader, data.val_dataloader()

    def ppl(model: Decoder) -> float:
        return evaluate_perplexity(model, val, cc.eval_batches).ppl

    if not cc.checkpoint:
        print(f"pretraining the GQA source for {run.train.max_steps} steps ...", flush=True)
        train_steps(
            source, train_fn, run.train.max_steps, run.train.lr, run.train.warmup_steps, run
        )
    source.eval()
    rows: dict[str, float] = {"source": ppl(source)}
    print(f"source ppl {rows['source']:.4f} ({time.time() - t0:.0f}s)", flush=True)

    calib = torch.cat([b["input_ids"] for b in itertools.islice(train_fn(), cc.calib_batches)])
    kw = dict(weighting=cc.weighting, rotation=cc.rotation)
    t1 = time.time()
    mla, report = convert_to_mla_with_report(
        source, calib, cc.kv_lora_rank, cc.qk_rope_head_dim, **kw
    )
    convert_s = time.time() - t1
    rows["mla svd"] = ppl(mla)
    print(f"converted in {convert_s:.1f}s: ppl {rows['mla svd']:.4f}", flush=True)

    def heal(model: Decoder, name: str) -> None:
        if cc.heal_steps:
            train_steps(model, train_fn, cc.heal_steps, cc.heal_lr, cc.heal_warmup_steps, run)
            rows[f"{name} + heal"] = ppl(model)
            print(f"{name} + heal ppl {rows[f'{name} + heal']:.4f}", flush=True)

    if cc.random_baseline:
        rand, _ = convert_to_mla_with_report(
            source, calib, cc.kv_lora_rank, cc.qk_rope_head_dim, init="random"
        )
        rows["mla random"] = ppl(rand)
        heal(rand, "mla random")
    heal(mla, "mla svd")
    if cc.control:
        control = Decoder(source.config)
        control.load_state_dict(source.state_dict())
        heal(control, "source")

    out = Path(cc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    export_check = None
    if cc.export:
        from unicache_train.checkpoint.deepseek_v3 import export_deepseek_v3, import_deepseek_v3

        path = export_deepseek_v3(mla, out / "deepseek_v3")
        ids = calib[:2]
        with torch.no_grad():
            export_check = (import_deepseek_v3(path)(ids).logits - mla(ids).logits).abs().max()
        export_check = float(export_check)

    before, after = kv_elements_per_token(source.config), kv_elements_per_token(mla.config)
    result = {
        "kv_elements_per_token_per_layer": {
            "gqa": before,
            "mla": after,
            "reduction": before / after,
        },
        "ppl": rows,
        "conversion": {
            "rope_stride": report.rope_stride,
            "rope_theta": report.rope_theta,
            "kept_frequencies": report.kept_frequencies,
            "seconds": convert_s,
            "layers": [asdict(layer) for layer in report.layers],
        },
        "export_max_abs_diff": export_check,
        "config": {"run": run.to_dict(), "convert": asdict(cc)},
        "wall_seconds": time.time() - t0,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_csv(out / "convert_to_mla.csv", result, command or "python recipes/convert_to_mla.py")
    _print_table(result)
    return result


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per evaluated model: KV elements per token per layer, perplexity, and its change
    vs the source and vs the fair reference (the source fine-tuned as long, ``source + heal``;
    NaN without ``convert.control``)."""
    kv = result["kv_elements_per_token_per_layer"]
    ppl = result["ppl"]
    fair = ppl.get("source + heal", float("nan"))
    return [
        {
            "model": name,
            "kv_elements_per_token_per_layer": kv["gqa" if name.startswith("source") else "mla"],
            "ppl": value,
            "vs_source": value / ppl["source"] - 1.0,
            "vs_fair_reference": value / fair - 1.0,
            "wall_s_total": f"{result['wall_seconds']:.0f}",
        }
        for name, value in ppl.items()
    ]


def write_csv(path: Path, result: dict[str, Any], command: str) -> None:
    """:func:`csv_rows` as CSV, led by the command, machine, torch version and wall time
    (:func:`unicache_train.recipe.results_header`, as the other results under
    ``experiments/*/results/``)."""
    from unicache_train.eval.report import write_csv as write

    rows = csv_rows(result)
    write(path, rows, list(rows[0]), header=results_header(command, result["wall_seconds"]))


def _print_table(result: dict[str, Any]) -> None:
    kv = result["kv_elements_per_token_per_layer"]
    ppl = result["ppl"]
    src = ppl["source"]
    print("\n| what | value |\n|---|---|")
    print(
        f"| KV elements / token / layer | GQA {kv['gqa']} -> MLA {kv['mla']} "
        f"({kv['reduction']:.2f}x fewer) |"
    )
    for name, value in ppl.items():
        print(f"| ppl {name} | {value:.4f} ({100 * (value / src - 1):+.1f}% vs source) |")
    if result["export_max_abs_diff"] is not None:
        print(
            f"| DeepseekV3 export -> import, max abs logit diff | "
            f"{result['export_max_abs_diff']:.2e} |"
        )


def cli(argv: list[str]) -> None:
    """``[--config FILE.yaml] [section.field=value ...]`` -> the run."""
    main(RecipeConfig.from_args(argv), command=command_line("convert_to_mla", argv))


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(lambda: cli(sys.argv[1:]))
