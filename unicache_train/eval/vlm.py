"""Per-task accuracy of a vision-language model under KV compression.

For every compression *variant* (a UniCache configuration family, :data:`VARIANTS`) and rate,
each evaluation prompt (image(s) + question) is prefilled through the model's compression seam,
every layer's context K/V is compressed, and the answer is decoded greedily **on the real
compressed cache** (:func:`~unicache_train.model.generate.generate_compressed`; packed int8
storage dequantized on the fly). Accuracy is the exact match of the decoded answer with the
reference (:func:`~unicache_train.data.synthetic.normalize_answer` on both), per task type.
The uncompressed reference decodes the same way with the identity compressor.

Reported per row (model, variant, rate): the realized rate next to the requested one
(``rate_realized``, context tokens removed, and ``budget_shortfall``, their gap when modality caps
or protection withhold removal), accuracy per task and overall, the realized rate per modality
(``rate_realized/<modality>``: context tokens of that modality removed, mean over layers and
prompts), the fraction of context tokens protected as alignment tokens, and the KV reduction
(``kv_reduction``: the 16-bit uncompressed cache of the same prompts over the stored bytes of the
compressed cache, payload + scales + merge counts / head maps, all layers). Words:
docs/architecture.md#words.

Variants (the issue's (a)-(d) plus ablations that isolate one step each):

* ``text_style``: global attention normalization, one uniform rate for every modality, no
  protection (``presets.text_style_baseline``), the issue's (a);
* ``text_style_pooled``: global normalization and one pooled budget (a text method's global
  top-k: modalities compete for the removal), no protection (``presets.text_style_pooled``);
* ``pooled_modality_norm``: the same pooled budget with per-modality normalization (isolates
  the normalization inside a pooled budget, where the source's "ignores the image" would
  show);
* ``unicache``: the full pipeline at its defaults (b); on a compression-aware fine-tuned model
  it is (d);
* ``unicache_no_protect``: the full pipeline without alignment protection (c);
* ``unicache_global_norm``: the full pipeline with global instead of per-modality normalization
  (isolates the normalization claim);
* ``unicache_uniform``: the full pipeline with one uniform rate instead of density budgets.

Shape legend: B, P, N, C = prompts, prompt tokens, image slots, width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unicache_train.data.multimodal import encode_sample
from unicache_train.data.scenes import TASKS, SceneConfig, scene_samples
from unicache_train.eval.budget import unicache_at_rate
from unicache_train.eval.report import text_table, write_csv
from unicache_train.seam import IdentityCompressor, KVCompressor
from unicache_train.validation import ConfigError
from unicache_train.validation import check_int as _int

__all__ = [
    "VARIANTS",
    "VLMEvalConfig",
    "variant_config",
    "build_prompts",
    "answer_accuracy",
    "evaluate_vlm",
    "format_vlm_table",
    "write_vlm_outputs",
    "plot_accuracy",
    "VLM_CSV_COLUMNS",
]


def _text_style(cfg: Any) -> None:
    cfg.importance.normalize = "global"
    cfg.budget.enabled = False
    cfg.protect.enabled = False


def _text_style_pooled(cfg: Any) -> None:
    cfg.importance.normalize = "global"
    cfg.budget.allocation = "pooled"
    cfg.protect.enabled = False


def _pooled_modality_norm(cfg: Any) -> None:
    cfg.budget.allocation = "pooled"
    cfg.protect.enabled = False


def _no_protect(cfg: Any) -> None:
    cfg.protect.enabled = False


def _global_norm(cfg: Any) -> None:
    cfg.importance.normalize = "global"


def _uniform(cfg: Any) -> None:
    cfg.budget.enabled = False


#: variant name -> edit applied to a copy of the base UniCache config.
VARIANTS: dict[str, Callable[[Any], None]] = {
    "text_style": _text_style,
    "text_style_pooled": _text_style_pooled,
    "pooled_modality_norm": _pooled_modality_norm,
    "unicache": lambda cfg: None,
    "unicache_no_protect": _no_protect,
    "unicache_global_norm": _global_norm,
    "unicache_uniform": _uniform,
}


def variant_config(base: Any, variant: str, rate: float, quantize: str = "config") -> Any:
    """The :class:`~unicache_train.compress.UniCacheConfig` of ``variant`` at target ``rate``.

    Args:
        base: the UniCache config the variants edit (normally the defaults, or a fine-tuned
            run's ``compress.unicache``).
        variant: a key of :data:`VARIANTS`.
        rate: target rate (fraction of context tokens removed, mean over layers).
        quantize: ``"config"``, ``"none"``, ``"int8"`` or ``"int4"``.
    """
    from unicache_train.compress.config import UniCacheConfig

    if variant not in VARIANTS:
        raise ConfigError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
    cfg = UniCacheConfig.from_dict(base.to_dict())
    VARIANTS[variant](cfg)
    return unicache_at_rate(UniCacheConfig.from_dict(cfg.to_dict()), rate, quantize)


@dataclass
class VLMEvalConfig:
    """What :func:`evaluate_vlm` measures.

    Attributes:
        rates: target rates per variant (fraction of context tokens removed).
        variants: keys of :data:`VARIANTS`.
        num_per_task: evaluation prompts per task type (balanced).
        seed: seed of the evaluation scenes (distinct from the training seed).
        batch_size: prompts decoded together.
        quantize: ``"config"`` (the base config's quantizer: int8 by default), ``"none"``,
            ``"int8"``, ``"int4"``.
        images_per_sample: ``[min, max]`` images per prompt (None: the data config's).
        progress: show progress bars.
    """

    rates: list[float] = field(default_factory=lambda: [0.3, 0.45, 0.6, 0.75])
    variants: list[str] = field(
        default_factory=lambda: ["text_style", "unicache", "unicache_no_protect"]
    )
    num_per_task: int = 100
    seed: int = 10_007
    batch_size: int = 50
    quantize: str = "config"
    images_per_sample: list[int] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        from unicache_train.compress.config import MAX_RATE

        if not isinstance(self.rates, (list, tuple)) or not self.rates:
            raise ConfigError(f"VLMEvalConfig.rates={self.rates!r}: expected a non-empty list")
        for r in self.rates:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= MAX_RATE:
                raise ConfigError(
                    f"VLMEvalConfig.rates: {r!r} is out of range; allowed [0, {MAX_RATE}]"
                )
        self.rates = [float(r) for r in self.rates]
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ConfigError(
                f"VLMEvalConfig.variants={self.variants!r}: {bad or 'empty'}; choose from "
                f"{sorted(VARIANTS)}"
            )
        _int(self, "num_per_task", 1)
        _int(self, "seed", 0)
        _int(self, "batch_size", 1)
        if self.quantize not in ("config", "none", "int8", "int4"):
            raise ConfigError(
                f"VLMEvalConfig.quantize={self.quantize!r} is not allowed; choose one of "
                "['config', 'none', 'int8', 'int4']"
            )


# ----------------------------------------------------------------------------- prompts
@dataclass
class PromptBatch:
    """Right-padded prompts (image(s) + question) and their references.

    Attributes:
        input_ids, modality_ids: [B, P]; split: [B] prompt lengths.
        pixel_values: [B, N, 3, H, W]; image_mask: [B, N].
        answers, tasks: the references and task types.
    """

    input_ids: torch.Tensor
    modality_ids: torch.Tensor
    split: torch.Tensor
    pixel_values: torch.Tensor
    image_mask: torch.Tensor
    answers: list[str]
    tasks: list[str]
    max_answer_tokens: int


def build_prompts(
    samples: Sequence[dict[str, Any]], tokenizer, patches_per_image: int, batch_size: int
) -> list[PromptBatch]:
    """Encode scene samples (:func:`~unicache_train.data.scenes.make_sample` dicts) as prompt
    batches; the prompt ends where the answer starts."""
    out = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        encs = [
            encode_sample(s["prompt"], s["answer"], len(s["images"]), tokenizer, patches_per_image)
            for s in chunk
        ]
        P = max(e["answer_start"] for e in encs)
        N = max(len(s["images"]) for s in chunk)
        S = chunk[0]["images"][0].shape[-1]
        B = len(chunk)
        ids = torch.full((B, P), tokenizer.pad_token_id, dtype=torch.long)
        mods = torch.zeros(B, P, dtype=torch.long)
        pix = torch.zeros(B, N, 3, S, S)
        mask = torch.zeros(B, N, dtype=torch.bool)
        for b, (s, e) in enumerate(zip(chunk, encs)):
            n = e["answer_start"]
            ids[b, :n] = torch.from_numpy(e["ids"][:n])
            mods[b, :n] = torch.from_numpy(e["modality"][:n])
            for i, img in enumerate(s["images"]):
                pix[b, i] = torch.from_numpy(img)
                mask[b, i] = True
        n_ans = max(len(e["ids"]) - e["answer_start"] for e in encs)
        out.append(
            PromptBatch(
                ids,
                mods,
                torch.tensor([e["answer_start"] for e in encs]),
                pix,
                mask,
                [s["answer"] for s in chunk],
                [s["task"] for s in chunk],
                n_ans,
            )
        )
    return out


def _progress(items: Iterable, total: int, description: str, enabled: bool) -> Iterable:
    if not enabled:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)


# ----------------------------------------------------------------------------- one setting
#: Per-layer compressor stats averaged over layers and prompts (context tokens removed per
#: modality and overall; protected alignment tokens).
_LAYER_STATS = (
    "rate_realized",
    "rate_realized/text",
    "rate_realized/vision",
    "rate_realized/audio",
    "protected_fraction",
)


@torch.no_grad()
def answer_accuracy(
    model,
    tokenizer,
    batches: Sequence[PromptBatch],
    compressor: KVCompressor,
    embeds: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Greedy answers on the compressed cache of every prompt; accuracy and cache statistics.

    Args:
        model: a :class:`~unicache_train.model.vlm.VisionLanguageModel` (GQA attention).
        batches: from :func:`build_prompts`.
        compressor: the KV compressor (the identity for the uncompressed reference).
        embeds: per batch, the prompt embeddings (``model.embed``), to reuse across settings.

    Returns:
        dict with ``acc/<task>`` and ``acc`` (fractions), ``rate_realized`` and
        ``rate_realized/<modality>``, ``protected_fraction``, ``kv_reduction``, ``n`` and
        ``predictions``.
    """
    from unicache_train.data.synthetic import normalize_answer
    from unicache_train.model.generate import generate_compressed

    device = next(model.parameters()).device
    hits: dict[str, list[int]] = {t: [0, 0] for t in TASKS}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    kv = base = 0
    preds: list[str] = []
    for i, pb in enumerate(batches):
        ids, mods = pb.input_ids.to(device), pb.modality_ids.to(device)
        emb = (
            embeds[i]
            if embeds is not None
            else model.embed(ids, mods, pb.pixel_values.to(device), pb.image_mask.to(device))
        )
        gen = generate_compressed(
            model,
            ids,
            pb.split.to(device),
            compressor,
            pb.max_answer_tokens + 1,
            eos_token_id=tokenizer.eos_token_id,
            modality_ids=mods,
            inputs_embeds=emb,
        )
        for row, ref, task in zip(gen.tokens.tolist(), pb.answers, pb.tasks):
            text = tokenizer.decode(row)
            preds.append(text)
            hit = normalize_answer(text) == normalize_answer(ref)
            hits.setdefault(task, [0, 0])
            hits[task][0] += int(hit)
            hits[task][1] += 1
        # Layer means of the batch's stats, weighted by the batch's prompts.
        w = float(len(pb.answers))
        for stats in gen.cache.stats or []:
            for key in _LAYER_STATS:
                if key in stats:
                    sums[key] = sums.get(key, 0.0) + float(stats[key]) * w
                    counts[key] = counts.get(key, 0.0) + w
        kv += gen.cache.kv_bytes()
        base += gen.cache.baseline_bytes()  # widths from the segments (MLA: latent)
    out: dict[str, Any] = {}
    for task, (h, n) in hits.items():
        out[f"acc/{task}"] = h / n if n else float("nan")
    total = sum(n for _, n in hits.values())
    out["acc"] = sum(h for h, _ in hits.values()) / max(total, 1)
    out["n"] = total
    for key in _LAYER_STATS:
        out[key] = sums[key] / counts[key] if counts.get(key) else float("nan")
    if isinstance(compressor, IdentityCompressor):
        out["rate_realized"] = out["rate_realized/text"] = out["rate_realized/vision"] = 0.0
        out["protected_fraction"] = 0.0
    out["kv_reduction"] = base / kv if kv else float("nan")
    out["predictions"] = preds
    return out


# ----------------------------------------------------------------------------- the sweep
#: ``rate``: the requested target rate; ``rate_realized``: context tokens really removed (mean
#: over layers); ``budget_shortfall``: ``rate - rate_realized`` when positive (caps, protection).
VLM_CSV_COLUMNS = (
    "model",
    "variant",
    "rate",
    "rate_realized",
    "budget_shortfall",
    "acc",
    *(f"acc/{t}" for t in TASKS),
    "rate_realized/text",
    "rate_realized/vision",
    "protected_fraction",
    "kv_reduction",
    "n",
)


@torch.no_grad()
def evaluate_vlm(
    model,
    tokenizer,
    scenes: SceneConfig,
    base_unicache: Any,
    options: VLMEvalConfig | None = None,
    *,
    model_label: str = "base",
    configs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Per-task accuracy of ``model`` uncompressed and for every (variant, rate).

    Args:
        model: a :class:`~unicache_train.model.vlm.VisionLanguageModel` (set to eval here).
        tokenizer: the data's tokenizer.
        scenes: the scene task (the evaluation draws ``options.seed``, never the train seed).
        base_unicache: the UniCache config the variants edit.
        options: what to measure.
        model_label: the ``model`` column of the rows.
        configs: extra named UniCache configs evaluated as given (``variant`` = the name,
            ``rate`` = its target rate), e.g. fixed per-modality rates.

    Returns:
        Rows with :data:`VLM_CSV_COLUMNS`: ``uncompressed`` first, then one per setting.
    """
    from unicache_train.compress import UniCacheCompressor

    opts = options or VLMEvalConfig()
    if model.config.attention_type != "gqa":
        raise NotImplementedError("compressed decoding needs GQA attention (see inference.py)")
    model.eval()
    device = next(model.parameters()).device
    sc = scenes
    if opts.images_per_sample is not None:
        sc = SceneConfig(**{**vars(scenes), "images_per_sample": list(opts.images_per_sample)})
    samples = scene_samples(sc, opts.num_per_task * len(TASKS), opts.seed, list(TASKS))
    batches = build_prompts(samples, tokenizer, model.patches_per_image, opts.batch_size)
    embeds = [
        model.embed(
            b.input_ids.to(device),
            b.modality_ids.to(device),
            b.pixel_values.to(device),
            b.image_mask.to(device),
        )
        for b in batches
    ]
    settings: list[tuple[str, float, Any]] = [("uncompressed", math.nan, None)]
    for variant in opts.variants:
        for rate in opts.rates:
            settings.append(
                (variant, rate, variant_config(base_unicache, variant, rate, opts.quantize))
            )
    for name, cfg in (configs or {}).items():
        settings.append((name, cfg.target_rate, cfg))
    rows = []
    for variant, rate, cfg in _progress(
        settings, len(settings), f"evaluating {model_label}", opts.progress
    ):
        comp = IdentityCompressor() if cfg is None else UniCacheCompressor(cfg)
        res = answer_accuracy(model, tokenizer, batches, comp, embeds)
        realized = res["rate_realized"]
        shortfall = math.nan if math.isnan(rate) else max(rate - realized, 0.0)
        rows.append(
            {
                "model": model_label,
                "variant": variant,
                "rate": rate,
                "budget_shortfall": shortfall,
                **{k: v for k, v in res.items() if k != "predictions"},
            }
        )
    return rows


# ----------------------------------------------------------------------------- outputs
def format_vlm_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A fixed-width text table (default: :data:`VLM_CSV_COLUMNS`), 3 significant digits."""
    return text_table(rows, columns or VLM_CSV_COLUMNS, digits=3)


def write_vlm_outputs(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, name: str = "vlm_eval"
) -> tuple[Path, Path]:
    """``<out_dir>/<name>.csv`` (:data:`VLM_CSV_COLUMNS`, then any other keys of the rows,
    sorted) and ``<name>.png`` (:func:`plot_accuracy`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / f"{name}.csv", out / f"{name}.png"
    cols = list(VLM_CSV_COLUMNS)
    cols += sorted({k for r in rows for k in r} - set(cols))
    write_csv(csv_path, rows, cols)
    plot_accuracy(rows, png_path)
    return csv_path, png_path


_STYLE = {
    "text_style": ("tab:red", "(a) text-style baseline"),
    "text_style_pooled": ("tab:orange", "(a') text-style, pooled top-k"),
    "pooled_modality_norm": ("tab:olive", "pooled top-k, per-modality normalization"),
    "unicache": ("tab:blue", "(b) UniCache"),
    "unicache_no_protect": ("tab:purple", "(c) UniCache, no alignment protection"),
    "unicache_global_norm": ("tab:brown", "UniCache, global normalization"),
    "unicache_uniform": ("tab:gray", "UniCache, uniform budgets"),
}


#: Lines of models other than "base": (model, variant) -> (colour, style, label).
_MODEL_STYLE = {
    ("finetuned", "unicache"): (
        "tab:cyan",
        "-",
        "(d) UniCache after compression-aware fine-tuning",
    ),
    ("finetuned_control", "unicache"): (
        "tab:green",
        "--",
        "UniCache after plain fine-tuning (control)",
    ),
}


def _line_style(model: str, variant: str) -> tuple[str | None, str, str]:
    if model == "base":
        colour, label = _STYLE.get(variant, (None, variant))
        return colour, "-", label
    return _MODEL_STYLE.get((model, variant), (None, ":", f"{variant} [{model}]"))


def plot_accuracy(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """One column per task (plus overall), accuracy against the target rate (top row) and
    against the realized KV reduction (bottom row: settings compared at equal memory), one
    line per (model, variant); uncompressed accuracy of each model as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported; no display on servers and CI
    import matplotlib.pyplot as plt

    keys = [f"acc/{t}" for t in TASKS] + ["acc"]
    titles = list(TASKS) + ["all tasks"]
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7.6), sharey=True)
    models = list(dict.fromkeys(r["model"] for r in rows))
    dashes = ["-", "--", ":", "-."]
    for row, xkey, xlabel in (
        (0, "rate", "target rate (fraction of context tokens removed)"),
        (1, "kv_reduction", "KV reduction (16-bit uncompressed / stored bytes)"),
    ):
        for ax, key, t in zip(axes[row], keys, titles):
            for mi, m in enumerate(models):
                mine = [r for r in rows if r["model"] == m]
                base = next((r for r in mine if r["variant"] == "uncompressed"), None)
                if base is not None:
                    ax.axhline(
                        base[key],
                        color="black",
                        ls=dashes[mi % 4],
                        lw=0.8,
                        alpha=0.6,
                        label=f"{m}: uncompressed",
                    )
                for variant in dict.fromkeys(r["variant"] for r in mine):
                    if variant == "uncompressed":
                        continue
                    pts = sorted((r[xkey], r[key]) for r in mine if r["variant"] == variant)
                    if len(pts) < 2:
                        continue
                    colour, ls, label = _line_style(m, variant)
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        marker="o",
                        ms=3,
                        color=colour,
                        ls=ls,
                        lw=2.2 if m != "base" else 1.4,
                        label=label,
                    )
            ax.set_title(t)
            ax.set_xlabel(xlabel)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[row, 0].set_ylabel("exact-match accuracy")
    handles, labels = axes[0, -1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(title or "tiny VLM on synthetic scenes: accuracy under KV compression")
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
