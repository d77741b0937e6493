"""Compression-aware fine-tuning with xKV, side by side with UniCache at the same KV bytes.

    python recipes/finetune_xkv.py                     # pretrains the tiny base first (~5 min)
    python recipes/finetune_xkv.py \
        --checkpoint runs/finetune_compress/pretrain/checkpoints/last.ckpt
    python recipes/finetune_xkv.py recipe.train_reductions=[8] recipe.finetune_unicache=false \\
        train.max_steps=50 compress.xkv.gradient=causal

On a shared, loaded CPU set ``OMP_NUM_THREADS=1``.

Shares the fine-tune-from-a-base stages with ``finetune_compress.py`` through the library
(:mod:`unicache_train.recipe`: arguments, base pretraining, evaluation;
:class:`~unicache_train.train.run.InitFromCheckpoint`). Stages:

1. base: ``--checkpoint``, else pretrain the tiny model
   (``recipes/pretrain_tiny.yaml``, under ``<out_dir>/pretrain``, resumable);
2. evaluate the base uncompressed, under xKV at each of ``recipe.eval_reductions`` (rank chosen
   so the stored factors take ``1 / reduction`` of the 16-bit cache) and under UniCache at the same
   bytes (target rate calibrated on the first batch, int8): continuation perplexity, key-value
   recall decoded on the real compressed caches, attention/output KL, real KV bytes;
3. per reduction in ``recipe.train_reductions``: fine-tune from the base with xKV in the loop
   (``finetune_xkv.yaml``, ``<out_dir>/xkv_<R>x``) and, with ``recipe.finetune_unicache``,
   with UniCache at the calibrated rate (``<out_dir>/unicache_<R>x``); evaluate each under its
   own method and reduction;
4. print and write the table (``<out_dir>/finetune_xkv.csv``; per-stage CSV/PNG under
   ``<out_dir>/eval``).

Arguments: as ``finetune_compress.py`` (``--config``, ``--checkpoint``, ``recipe.FIELD=VALUE``,
``pretrain.SECTION.FIELD=VALUE``, ``SECTION.FIELD=VALUE``); the ``recipe`` section is
:class:`XKVOptions` (``finetune_compress``'s options plus ``recipe.eval_reductions``,
``recipe.train_reductions``, ``recipe.finetune_unicache``, ``recipe.control``). A reduction is
uncompressed 16-bit bytes / stored bytes (docs/architecture.md#words).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicache_train.recipe import (
    FinetuneOptions,
    base_stage,
    command_line,
    evaluate_stage,
    parse_finetune_args,
    write_results_csv,
)
from unicache_train.train.config import RunConfig
from unicache_train.validation import ConfigError

HERE = Path(__file__).resolve().parent


@dataclass
class XKVOptions(FinetuneOptions):
    """The ``recipe`` section: :class:`~unicache_train.recipe.FinetuneOptions`'s fields and

    Attributes:
        eval_reductions: KV reductions at which the base is evaluated (xKV and UniCache).
        train_reductions: one xKV fine-tune (and UniCache fine-tune) per reduction.
        finetune_unicache: also fine-tune UniCache at the same bytes, for the side-by-side.
        control: also fine-tune the same number of steps with the identity compressor (same
            splits, loss and KL, nothing compressed: ``<out_dir>/control``) and evaluate it
            under every setting; fine-tuning is also more training of a small base, and the
            control separates that from learning to tolerate compression.
    """

    eval_reductions: list[float] = field(default_factory=lambda: [4.0, 8.0])
    train_reductions: list[float] = field(default_factory=lambda: [4.0, 8.0])
    finetune_unicache: bool = True
    control: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("finetune_unicache", "control"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"recipe.{name}={getattr(self, name)!r}: expected a bool (true or false)"
                )
        for name in ("eval_reductions", "train_reductions"):
            values = getattr(self, name)
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and 1 <= v <= 64 for v in values
            ):
                raise ConfigError(
                    f"recipe.{name}={values!r}: expected a list of reductions in [1, 64]"
                )


def parse_args(argv: list[str]) -> tuple[XKVOptions, RunConfig]:
    """The arguments (see the module doc) -> the recipe options and the fine-tune config."""
    return parse_finetune_args(argv, HERE / "finetune_xkv.yaml", __doc__, XKVOptions)


def sub_config(ft: RunConfig, name: str, **compress: Any) -> RunConfig:
    """The fine-tune config of one run: ``compress`` fields replaced, its own out_dir."""
    d = ft.to_dict()
    d["train"]["out_dir"] = str(Path(ft.train.out_dir) / name)
    d["logging"]["name"] = f"{ft.logging.name}_{name}"
    for key, value in compress.items():
        if isinstance(value, dict):
            d["compress"][key] = {**d["compress"][key], **value}
        else:
            d["compress"][key] = value
    return RunConfig.from_dict(d)


def evaluate(model, config: RunConfig, tokenizer, loader, options, name: str, **kw):
    """:func:`~unicache_train.recipe.evaluate_stage`, its table printed."""
    from unicache_train.eval.report import format_table

    rows = evaluate_stage(model, config, tokenizer, loader, options, name, **kw)
    print(f"\n[{name}]\n" + format_table(rows))
    return rows


def table(
    base_rows, tuned: dict[tuple[float, str], list[dict[str, Any]]], control=None
) -> list[dict]:
    """One row per (reduction, method): the base and the fine-tuned model, compressed, plus the
    fine-tuned model uncompressed and the control (fine-tuned without compression) compressed
    and uncompressed; every reference is the base uncompressed."""
    ref = base_rows[0]
    out = []
    for k, r in enumerate(base_rows[1:]):
        method, label, target = r["method"], r["label"], r["target_reduction"]
        ctrl = control[k + 1] if control else None
        ft_rows = tuned.get((target, method))
        ft = ft_rows[1] if ft_rows else None
        ft_plain = ft_rows[0] if ft_rows else None

        def rel(x: float) -> float:
            return x / ref["ppl"] - 1.0

        nan = float("nan")
        out.append(
            {
                "target_reduction": target,
                "method": method,
                "setting": label,
                "kv_reduction": r["kv_reduction"],
                "ppl_base_uncompressed": ref["ppl"],
                "ppl_base_compressed": r["ppl"],
                "base_increase": rel(r["ppl"]),
                "ppl_ft_compressed": ft["ppl"] if ft else nan,
                "ft_increase": rel(ft["ppl"]) if ft else nan,
                "ppl_ft_uncompressed": ft_plain["ppl"] if ft_plain else nan,
                "ppl_ctrl_compressed": ctrl["ppl"] if ctrl else nan,
                "ctrl_increase": rel(ctrl["ppl"]) if ctrl else nan,
                "ppl_ctrl_uncompressed": control[0]["ppl"] if control else nan,
                "recall_base_uncompressed": ref["recall_acc"],
                "recall_base_compressed": r["recall_acc"],
                "recall_ft_compressed": ft["recall_acc"] if ft else nan,
                "recall_ctrl_compressed": ctrl["recall_acc"] if ctrl else nan,
                "attn_kl_base": r["attn_kl"],
                "attn_kl_ft": ft["attn_kl"] if ft else nan,
            }
        )
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    """Run the recipe; returns the table rows (None on ranks other than 0)."""
    from unicache_train.checkpoint import load_checkpoint
    from unicache_train.eval.report import text_table
    from unicache_train.train.run import InitFromCheckpoint, fit

    args = list(sys.argv[1:] if argv is None else argv)
    options, ft = parse_args(args)
    t0 = time.perf_counter()
    base = base_stage(options, ft)
    base_ckpt, base_model, loader, rank0, times = (
        base.checkpoint,
        base.model,
        base.loader,
        base.rank0,
        base.times,
    )

    t = time.perf_counter()
    base_rows = evaluate(
        base_model,
        ft,
        base.tokenizer,
        loader,
        options,
        "base",
        rates=[],
        xkv_reductions=options.eval_reductions,
        match_unicache=True,
    )
    times["eval_base"] = time.perf_counter() - t
    matched = {r["target_reduction"]: r["rate"] for r in base_rows if r["method"] == "unicache"}
    tuned: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for red in options.train_reductions:
        runs = [("xkv", sub_config(ft, f"xkv_{red:g}x", method="xkv", xkv={"reduction": red}))]
        if options.finetune_unicache:
            if red not in matched:
                raise ConfigError(
                    f"recipe.train_reductions: {red} is not in recipe.eval_reductions"
                )
            rate = matched[red]
            cfg = sub_config(
                ft, f"unicache_{red:g}x", method="unicache", unicache={"target_rate": rate}
            )
            runs.append(("unicache", cfg))
        for method, cfg in runs:
            t = time.perf_counter()
            trainer = fit(cfg, callbacks=[InitFromCheckpoint(base_ckpt)])
            times[f"finetune_{method}_{red:g}x"] = time.perf_counter() - t
            if not (trainer.is_global_zero and rank0):
                continue
            model, _ = load_checkpoint(Path(cfg.train.out_dir) / "checkpoints" / "last.ckpt")
            name = f"finetuned_{method}_{red:g}x"
            if method == "xkv":
                rows = evaluate(
                    model,
                    cfg,
                    base.tokenizer,
                    loader,
                    options,
                    name,
                    rates=[],
                    xkv_reductions=[red],
                    match_unicache=False,
                )
            else:
                rows = evaluate(
                    model,
                    cfg,
                    base.tokenizer,
                    loader,
                    options,
                    name,
                    rates=[cfg.compress.unicache.target_rate],
                )
                rows[1]["method"] = "unicache"
            tuned[(red, method)] = rows
    control = None
    if options.control:
        cfg = sub_config(ft, "control", method="none")
        t = time.perf_counter()
        trainer = fit(cfg, callbacks=[InitFromCheckpoint(base_ckpt)])
        times["finetune_control"] = time.perf_counter() - t
        if trainer.is_global_zero and rank0:
            model, _ = load_checkpoint(Path(cfg.train.out_dir) / "checkpoints" / "last.ckpt")
            # The base's settings (UniCache at the rates calibrated on the base), in the base's
            # row order.
            xrows = evaluate(
                model,
                cfg,
                base.tokenizer,
                loader,
                options,
                "control_xkv",
                rates=[],
                xkv_reductions=options.eval_reductions,
                match_unicache=False,
            )
            by_rate = evaluate(
                model,
                cfg,
                base.tokenizer,
                loader,
                options,
                "control_unicache",
                rates=[matched[r] for r in options.eval_reductions],
            )
            control = [xrows[0]]
            for r in base_rows[1:]:
                src = xrows if r["method"] == "xkv" else by_rate
                idx = options.eval_reductions.index(r["target_reduction"]) + 1
                control.append(src[idx])
    if not rank0:
        return None
    times["total"] = time.perf_counter() - t0
    rows = table(base_rows, tuned, control)
    xc = ft.compress.xkv
    print(
        f"\nxKV (group {xc.group_size}, {xc.gradient} gradient) vs UniCache "
        f"({ft.compress.preset}, int8) at the same KV bytes; base {base_ckpt}"
    )
    print(text_table(rows))
    print("increase: perplexity on continuations vs the base uncompressed")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    out = Path(ft.train.out_dir) / "finetune_xkv.csv"
    write_results_csv(out, rows, command_line("finetune_xkv", args), times["total"])
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(main)
