"""A tiny vision-language model under KV compression, end to end on CPU (no downloads):

    python recipes/vlm_tiny.py                        # everything below (resumable stages)
    python recipes/vlm_tiny.py --checkpoint BASE.ckpt # skip the base training
    python recipes/vlm_tiny.py train.max_steps=3000 recipe.num_per_task=200 \\
        finetune.train.max_steps=600 recipe.rate_grid=false
    fabric run --accelerator cpu --devices 2 --strategy ddp recipes/vlm_tiny.py   # training stages

On a shared, loaded CPU set ``OMP_NUM_THREADS=1`` (the compressor runs many small ops).

Stages (base config ``vlm_tiny.yaml``; fine-tune config ``vlm_tiny_finetune.yaml`` merged onto it):

0. **vision tower**: pretrain it on per-patch shape labels
   (:mod:`unicache_train.train.vision_pretrain`; real VLMs start from a pretrained encoder) unless
   ``vision.init_weights`` names one; saved as ``<train.out_dir>/vision_tower.safetensors`` and
   reused when present.
1. **base**: train the VLM (projector + decoder; the tower frozen as in ``vlm_tiny.yaml``)
   uncompressed on the synthetic scenes (:mod:`unicache_train.data.scenes`: describe / count /
   refer), split at the answer, loss on the answer; resumable (``<train.out_dir>``, default
   ``runs/vlm_tiny/base``).
2. **evaluate the base** per task type: greedy answers decoded on the real compressed cache
   (:mod:`unicache_train.eval.vlm`) uncompressed and for each variant x rate: (a)
   ``text_style`` (global normalization, uniform budgets, no protection), (a')
   ``text_style_pooled`` (global normalization, one pooled top-k budget), (b) ``unicache``,
   (c) ``unicache_no_protect``, and the ablation ``unicache_global_norm``.
3. **fine-tune** with UniCache in the training loop (``LMModule``'s in-loop compression: KL to
   the uncompressed forward, rate curriculum), from the base weights (resumable).
4. **evaluate the fine-tuned model**: uncompressed and (d) ``unicache``.
   **control** (``recipe.control_finetune``): the same fine-tune with ``compress.method=none``
   (same steps, data, splits and loss, nothing compressed), evaluated the same way, so (d) is
   compared with "more training" and not only with the base.
5. **rate grid** (``recipe.rate_grid``): fixed visual x text rates (mean over layers) with the
   rest of UniCache at its defaults (on the base also without alignment protection), on both
   models: where is accuracy stable?
6. **outputs** under ``recipe.results_dir`` (default ``<base out_dir>/../results``):
   ``vlm_eval.csv`` / ``.md`` / ``.png`` (accuracy per task vs rate), ``vlm_rate_grid.csv`` /
   ``.png``, ``claims.md`` (the source's claims checked against these numbers).

Arguments (:mod:`unicache_train.recipe`): ``--config BASE.yaml``, ``--checkpoint PATH``
(``recipe.base_checkpoint``), ``recipe.FIELD=VALUE`` (:class:`RecipeOptions`),
``finetune.SECTION.FIELD=VALUE`` (over ``recipe.finetune_config``) and ``SECTION.FIELD=VALUE``
(the base :class:`~unicache_train.train.vlm.VLMRunConfig`). A single training run of this model
is ``unicache-train vlm --config recipes/vlm_tiny.yaml``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unicache_train.compress.config import MAX_RATE
from unicache_train.recipe import build_section, parse_recipe_args, run_sections
from unicache_train.validation import ConfigError, deep_merge, load_yaml
from unicache_train.validation import check_int as _int

HERE = Path(__file__).resolve().parent


@dataclass
class RecipeOptions:
    """Recipe-level knobs (``recipe.FIELD=VALUE``).

    Attributes:
        base_checkpoint: the base model; None trains it first.
        finetune_config: YAML merged onto the base config for the fine-tune.
        finetune: overrides of it, the top-level ``finetune`` section
            (``finetune.train.max_steps=600``).
        skip_finetune: stop after evaluating the base (and its rate grid).
        rates: target rates of every variant.
        variants: variants evaluated on the base (:data:`~unicache_train.eval.vlm.VARIANTS`).
        finetuned_variants: variants evaluated on the fine-tuned model.
        num_per_task: evaluation prompts per task type.
        eval_seed: seed of the evaluation scenes.
        eval_batch_size: prompts decoded together.
        rate_grid: run the fixed visual x text rate grid.
        grid_vision, grid_text: the grid's visual and text rates.
        results_dir: where tables and plots go (default ``<base out_dir>/../results``).
        vision_steps: steps of the vision tower pretraining (stage 0).
        control_finetune: also run the plain (uncompressed) fine-tune control.
    """

    base_checkpoint: str | None = None
    finetune_config: str = str(HERE / "vlm_tiny_finetune.yaml")
    finetune: dict[str, Any] = field(default_factory=dict)
    skip_finetune: bool = False
    rates: list[float] = field(default_factory=lambda: [0.3, 0.45, 0.6, 0.75])
    variants: list[str] = field(
        default_factory=lambda: [
            "text_style",
            "text_style_pooled",
            "pooled_modality_norm",
            "unicache",
            "unicache_no_protect",
            "unicache_global_norm",
        ]
    )
    finetuned_variants: list[str] = field(default_factory=lambda: ["unicache"])
    num_per_task: int = 200
    eval_seed: int = 10_007
    eval_batch_size: int = 50
    rate_grid: bool = True
    grid_vision: list[float] = field(default_factory=lambda: [0.5, 0.65, 0.7, 0.75, 0.8])
    grid_text: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.2, 0.25, 0.3, 0.4])
    results_dir: str | None = None
    vision_steps: int = 300
    control_finetune: bool = True

    def __post_init__(self) -> None:
        for name in ("skip_finetune", "rate_grid", "control_finetune"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"RecipeOptions.{name}={getattr(self, name)!r}: expected a bool (true or false)"
                )
        _int(self, "num_per_task", 1)
        _int(self, "eval_seed", 0)
        _int(self, "eval_batch_size", 1)
        _int(self, "vision_steps", 0)
        for name in ("rates", "grid_vision", "grid_text"):
            values = getattr(self, name)
            if not isinstance(values, list) or not all(
                not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= MAX_RATE
                for v in values
            ):
                raise ConfigError(
                    f"RecipeOptions.{name}={values!r}: expected a list of rates in [0, {MAX_RATE}]"
                )


def parse_args(argv: list[str]) -> tuple[RecipeOptions, Any]:
    """The arguments (see the module doc) -> the recipe options and the base config."""
    from unicache_train.train.vlm import VLMRunConfig

    sections = {
        "recipe": RecipeOptions,
        "finetune": "overrides of recipe.finetune_config (finetune.train.max_steps=600)",
        **run_sections(VLMRunConfig),
    }
    data = parse_recipe_args(
        argv,
        HERE / "vlm_tiny.yaml",
        sections,
        doc=__doc__,
        flags={"--checkpoint": "recipe.base_checkpoint"},
    )
    options = build_section(RecipeOptions, data, "recipe", lifted=("finetune",))
    return options, VLMRunConfig.from_dict(data)


def finetune_config(options: RecipeOptions, base: Any) -> Any:
    """The base config with the fine-tune YAML and its overrides merged on top."""
    from unicache_train.train.vlm import VLMRunConfig

    path = Path(options.finetune_config)
    if not path.is_file():
        raise FileNotFoundError(f"recipe.finetune_config={str(path)!r}: no such file")
    over = deep_merge(load_yaml(path.read_text()) or {}, options.finetune)
    d = base.to_dict()
    d["compress"].pop("unicache")  # the fine-tune's preset + overrides decide it
    return VLMRunConfig.from_dict(deep_merge(d, over))


def pretrain_tower(options: RecipeOptions, base: Any, wait_s: float = 1800.0) -> Path:
    """Stage 0: the pretrained tower's weights file (trained once by rank 0, then reused; other
    ranks of a ``fabric run`` wait for it)."""
    from unicache_train.model.vision import VisionEncoder
    from unicache_train.train.vision_pretrain import VisionPretrainConfig, pretrain_vision_tower

    path = Path(base.train.out_dir) / "vision_tower.safetensors"
    if int(os.environ.get("RANK", "0")) != 0:
        deadline = time.monotonic() + wait_s
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not write {path} within {wait_s:.0f} s")
            time.sleep(2.0)
        return path
    if path.is_file():
        return path
    import torch

    torch.manual_seed(base.train.seed)
    tower = VisionEncoder(base.vision)
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    stats = pretrain_vision_tower(
        tower, base.data.scenes, VisionPretrainConfig(steps=options.vision_steps), save_to=tmp
    )
    os.replace(tmp, path)  # NOTE: other ranks poll for `path`: it appears complete or not at all
    print(f"vision tower pretrained: {stats}; saved {path}")
    return path


def control_config(ft: Any) -> Any:
    """The fine-tune with nothing compressed: same steps, data, splits and loss."""
    from unicache_train.train.vlm import VLMRunConfig

    d = ft.to_dict()
    d["compress"].update(method="none", kl_weight=0.0, curriculum_steps=0)
    d["train"]["out_dir"] = str(Path(ft.train.out_dir).parent / "finetune_control")
    d["logging"]["name"] = f"{ft.logging.name or 'vlm_tiny'}_control"
    return VLMRunConfig.from_dict(d)


def grid_configs(base_unicache: Any, vision: list[float], text: list[float]) -> dict[str, Any]:
    """UniCache at its defaults with fixed visual and text rates (mean over layers)."""
    from unicache_train.compress.config import UniCacheConfig

    out = {}
    for v in vision:
        for t in text:
            d = base_unicache.to_dict()
            d["rate_scale"] = 1.0
            d["budget"] = {**d["budget"], "vision_rate": v, "text_rate": t}
            out[f"fixed v={v:g} t={t:g}"] = UniCacheConfig.from_dict(d)
    return out


# ----------------------------------------------------------------------------- reporting
def _acc_drop(rows: list[dict], model: str, variant: str, rate: float, key: str) -> float:
    ref = next(r for r in rows if r["model"] == model and r["variant"] == "uncompressed")
    row = next(
        (r for r in rows if r["model"] == model and r["variant"] == variant and r["rate"] == rate),
        None,
    )
    return float("nan") if row is None else 100.0 * (ref[key] - row[key])


def claims_report(rows: list[dict], grid: list[dict], rate: float = 0.6) -> str:
    """The source's three claims, checked against the measured rows (markdown)."""

    def get(model: str, variant: str, r: float) -> dict | None:
        return next(
            (x for x in rows if x["model"] == model and x["variant"] == variant and x["rate"] == r),
            None,
        )

    lines = ["# Source claims vs this run", ""]
    base_unc = next(r for r in rows if r["model"] == "base" and r["variant"] == "uncompressed")
    lines.append(
        "Uncompressed base accuracy: "
        + ", ".join(f"{t} {base_unc[f'acc/{t}']:.3f}" for t in ("describe", "count", "refer"))
        + "."
    )
    lines += ["", "## 1. Global normalization makes the model ignore the image", ""]
    lines.append(
        "| variant | rate | vision removed | text removed | acc | describe | count | refer |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for variant in (
        "unicache",
        "unicache_global_norm",
        "text_style",
        "text_style_pooled",
        "pooled_modality_norm",
    ):
        for r in sorted({x["rate"] for x in rows if x["variant"] == variant}):
            row = get("base", variant, r)
            if row is None:
                continue
            lines.append(
                f"| {variant} | {r:g} | {row['rate_realized/vision']:.3f} | "
                f"{row['rate_realized/text']:.3f} | {row['acc']:.3f} | {row['acc/describe']:.3f} | "
                f"{row['acc/count']:.3f} | {row['acc/refer']:.3f} |"
            )
    lines += ["", "## 2. Alignment protection on the referring task", ""]
    for r in sorted({x["rate"] for x in rows if x["variant"] == "unicache"}):
        with_p = _acc_drop(rows, "base", "unicache", r, "acc/refer")
        without = _acc_drop(rows, "base", "unicache_no_protect", r, "acc/refer")
        prot = get("base", "unicache", r)
        frac = prot["protected_fraction"] if prot else float("nan")
        lines.append(
            f"- rate {r:g}: referring accuracy loss {without:+.1f} points without protection, "
            f"{with_p:+.1f} with (protected tokens: {100 * frac:.1f}% of the context)"
        )
    lines.append("")
    lines.append(
        f"Source: 15 -> 4 points at 60% compression. Here at {rate:g}: "
        f"{_acc_drop(rows, 'base', 'unicache_no_protect', rate, 'acc/refer'):+.1f} -> "
        f"{_acc_drop(rows, 'base', 'unicache', rate, 'acc/refer'):+.1f} points."
    )
    if grid:
        lines += ["", "## 3. Visual 0.65-0.75 with text 0.20-0.30 is a stable region", ""]
        for model in dict.fromkeys(g["model"] for g in grid):
            ref = next(g for g in grid if g["model"] == model and g["variant"] == "uncompressed")
            mine = [g for g in grid if g["model"] == model and g["variant"] != "uncompressed"]
            inside = [
                g for g in mine if 0.65 <= g["vision_rate"] <= 0.75 and 0.2 <= g["text_rate"] <= 0.3
            ]
            outside = [g for g in mine if g not in inside]

            lines.append(
                f"- {model}: worst overall accuracy loss inside the region "
                f"{_worst(inside, ref)}; outside {_worst(outside, ref)} (uncompressed "
                f"{ref['acc']:.3f})"
            )
    return "\n".join(lines) + "\n"


def _worst(grid: list[dict], ref: dict) -> str:
    if not grid:
        return "-"
    g = max(grid, key=lambda x: ref["acc"] - x["acc"])
    loss = 100 * (ref["acc"] - g["acc"])
    return f"{loss:+.1f} points at v={g['vision_rate']:g} t={g['text_rate']:g}"


def markdown_table(rows: list[dict]) -> str:
    cols = [
        "model",
        "variant",
        "rate",
        "acc/describe",
        "acc/count",
        "acc/refer",
        "acc",
        "rate_realized/vision",
        "rate_realized/text",
        "protected_fraction",
        "kv_reduction",
    ]
    head = [
        "model",
        "variant",
        "rate",
        "describe",
        "count",
        "refer",
        "all",
        "vision removed",
        "text removed",
        "protected",
        "KV reduction",
    ]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3f}".rstrip("0").rstrip(".") if v else "0"
        return str(v)

    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def plot_grid(grid: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(dict.fromkeys(g["model"] for g in grid))
    keys = ["acc", "acc/refer"]
    fig, axes = plt.subplots(
        len(models), len(keys), figsize=(5.2 * len(keys), 4.2 * len(models)), squeeze=False
    )
    for mi, model in enumerate(models):
        ref = next(g for g in grid if g["model"] == model and g["variant"] == "uncompressed")
        mine = [g for g in grid if g["model"] == model and g["variant"] != "uncompressed"]
        vs = sorted({g["vision_rate"] for g in mine})
        ts = sorted({g["text_rate"] for g in mine})
        for ki, key in enumerate(keys):
            ax = axes[mi, ki]
            drop = np.full((len(ts), len(vs)), np.nan)
            for g in mine:
                drop[ts.index(g["text_rate"]), vs.index(g["vision_rate"])] = 100 * (
                    ref[key] - g[key]
                )
            im = ax.imshow(
                drop, origin="lower", cmap="RdYlGn_r", vmin=0, vmax=max(20, float(np.nanmax(drop)))
            )
            for (ti, vi), d in np.ndenumerate(drop):
                ax.text(vi, ti, f"{d:.0f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(vs)), [f"{v:g}" for v in vs])
            ax.set_yticks(range(len(ts)), [f"{t:g}" for t in ts])
            ax.set_xlabel("visual rate (fraction removed)")
            ax.set_ylabel("text rate")
            # The source's region: visual 0.65-0.75, text 0.20-0.30.
            inside_v = [i for i, v in enumerate(vs) if 0.65 <= v <= 0.75]
            inside_t = [i for i, t in enumerate(ts) if 0.2 <= t <= 0.3]
            if inside_v and inside_t:
                ax.add_patch(
                    plt.Rectangle(
                        (inside_v[0] - 0.5, inside_t[0] - 0.5),
                        len(inside_v),
                        len(inside_t),
                        fill=False,
                        lw=2,
                    )
                )
            ax.set_title(f"{model}: {key} loss (points)")
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(
        "accuracy loss vs uncompressed at fixed visual x text rates (box: source's stable region)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_csv(rows: list[dict], path: Path) -> Path:
    """Every key of the rows as a column, in first-seen order (:func:`eval.report.write_csv`)."""
    from unicache_train.eval.report import write_csv as write

    return write(path, rows, list(dict.fromkeys(k for r in rows for k in r)))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the recipe; returns the rows (None on ranks other than 0)."""
    from unicache_train.data.multimodal import load_multimodal_tokenizer
    from unicache_train.eval.vlm import (
        VLMEvalConfig,
        evaluate_vlm,
        format_vlm_table,
        plot_accuracy,
        variant_config,
    )
    from unicache_train.train.run import InitFromCheckpoint
    from unicache_train.train.vlm import fit_vlm, load_vlm_checkpoint

    args = list(sys.argv[1:] if argv is None else argv)
    options, base_cfg = parse_args(args)
    # NOTE: under `fabric run` every rank runs the training stages (DDP needs them all); only
    # rank 0 evaluates and writes, the others wait at the next fit.
    rank0 = int(os.environ.get("RANK", "0")) == 0
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if options.base_checkpoint is None and base_cfg.vision.init_weights is None:
        base_cfg.vision.init_weights = str(pretrain_tower(options, base_cfg))
        times["vision_pretrain"] = time.perf_counter() - t0
    if options.base_checkpoint is None:
        fit_vlm(base_cfg)
        base_ckpt = Path(base_cfg.train.out_dir) / "checkpoints" / "last.ckpt"
    else:
        base_ckpt = Path(options.base_checkpoint)
    times["base_train"] = time.perf_counter() - t0
    base_model, base_cfg = load_vlm_checkpoint(base_ckpt)
    ft_cfg = finetune_config(options, base_cfg)
    tok = load_multimodal_tokenizer(base_cfg.data.tokenizer)
    scenes = base_cfg.data.scenes
    uc = ft_cfg.compress.unicache  # (b) and (d): the same UniCache setting
    ev = dict(
        rates=options.rates,
        num_per_task=options.num_per_task,
        seed=options.eval_seed,
        batch_size=options.eval_batch_size,
    )

    def evaluate(model, label: str, variants: list[str]) -> list[dict]:
        t = time.perf_counter()
        out = evaluate_vlm(
            model, tok, scenes, uc, VLMEvalConfig(variants=variants, **ev), model_label=label
        )
        times[f"eval_{label}"] = time.perf_counter() - t
        print(format_vlm_table(out))
        return out

    rows = evaluate(base_model, "base", options.variants) if rank0 else []
    tuned_model = None
    if not options.skip_finetune:
        t = time.perf_counter()
        fit_vlm(ft_cfg, callbacks=[InitFromCheckpoint(base_ckpt)])
        times["finetune"] = time.perf_counter() - t
        tuned_model, _ = load_vlm_checkpoint(
            Path(ft_cfg.train.out_dir) / "checkpoints" / "last.ckpt"
        )
        if rank0:
            rows += evaluate(tuned_model, "finetuned", options.finetuned_variants)
        if options.control_finetune:
            t = time.perf_counter()
            ctl_cfg = control_config(ft_cfg)
            fit_vlm(ctl_cfg, callbacks=[InitFromCheckpoint(base_ckpt)])
            times["control"] = time.perf_counter() - t
            if rank0:
                ctl_model, _ = load_vlm_checkpoint(
                    Path(ctl_cfg.train.out_dir) / "checkpoints" / "last.ckpt"
                )
                rows += evaluate(ctl_model, "finetuned_control", options.finetuned_variants)
    if not rank0:
        return None
    results = Path(options.results_dir or Path(base_cfg.train.out_dir).parent / "results")
    results.mkdir(parents=True, exist_ok=True)

    grid: list[dict] = []
    if options.rate_grid:
        t = time.perf_counter()
        configs = grid_configs(uc, options.grid_vision, options.grid_text)
        no_protect = {
            k: variant_config(c, "unicache_no_protect", c.target_rate) for k, c in configs.items()
        }
        for label, model, cfgs in (
            ("base", base_model, configs),
            ("base, no protection", base_model, no_protect),
            ("finetuned", tuned_model, configs),
        ):
            if model is None:
                continue
            g = evaluate_vlm(
                model,
                tok,
                scenes,
                uc,
                VLMEvalConfig(
                    variants=["unicache"],
                    rates=[uc.target_rate],
                    **{k: v for k, v in ev.items() if k != "rates"},
                ),
                model_label=label,
                configs=cfgs,
            )
            for r in g:
                c = cfgs[r["variant"]].budget if r["variant"] in cfgs else None
                if c is not None or r["variant"] == "uncompressed":
                    vr, tr = (c.vision_rate, c.text_rate) if c is not None else (math.nan,) * 2
                    grid.append({**r, "vision_rate": vr, "text_rate": tr})
        times["rate_grid"] = time.perf_counter() - t

    plot_accuracy(rows, results / "vlm_eval.png")
    write_csv(rows, results / "vlm_eval.csv")
    (results / "vlm_eval.md").write_text(markdown_table(rows))
    if grid:
        write_csv(grid, results / "vlm_rate_grid.csv")
        plot_grid(grid, results / "vlm_rate_grid.png")
    claims = claims_report(rows, grid)
    (results / "claims.md").write_text(claims)
    times["total"] = time.perf_counter() - t0
    print(claims)
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    print(f"wrote {results}")
    return {"rows": rows, "grid": grid, "times": times}


if __name__ == "__main__":
    from unicache_train.cli import report_user_errors

    report_user_errors(main)
