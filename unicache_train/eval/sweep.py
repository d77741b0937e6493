"""Quality under KV compression across rates and xKV reductions: the ``evaluate --compression``
sweep.

Shape legend: B, T = batch, tokens.

:func:`evaluate_compression` measures, for a model and a list of settings (UniCache rates, xKV
reductions; docs/architecture.md#words, #quality-checks and #targets):

* **perplexity on continuations**, uncompressed and compressed, on the same tokens: each eval
  sample is split (the data's split, e.g. a recall answer, else a seeded random one, as in
  training); targets from position ``split - 1`` on count. Compressed = the in-loop forward
  (prefill, compress, continuation attends to the compressed cache), which equals decoding on
  the real compressed cache (``tests/test_inloop.py``).
* **key-value recall accuracy** on freshly generated prompts of the bundled synthetic task,
  decoded on the real compressed cache (:mod:`unicache_train.eval.synthetic_recall`).
* **attention KL** (``compress/attn_kl``) on the last ``attn_kl_layers`` layers
  (:mod:`unicache_train.eval.attn_kl`), mean over continuation queries, heads and layers.
* **output KL** (``compress/output_kl``): ``KL(p_full || p_compressed)`` of the next-token
  distributions on continuation targets.
* **KV reduction** (``kv_reduction``): the uncompressed 16-bit cache of the same prompts over
  the bytes of the real compressed cache (packed int8/int4 + scales + merge counts / head
  maps), all layers; ``4.0`` = 4x fewer KV bytes.
* **quality checks** (docs/architecture.md#quality-checks): ``kl_ok`` (attn KL < 0.1), ``ppl_ok``
  (perplexity at most +5%), ``acc_ok`` (recall accuracy at most 5 points lower), ``pass`` (all
  three). A check that cannot measure anything reads n/a (``None``): ``acc_ok`` when the
  uncompressed model recalls nothing, ``kl_ok`` without attention KL; ``pass`` is then n/a unless
  another check failed.
* **realized rate** (``rate_realized``): the fraction of context tokens really removed, next to
  the requested ``rate``, and their gap ``budget_shortfall`` (modality caps, protection).

Besides UniCache at each rate, ``xkv_reductions`` adds xKV rows (cross-layer SVD, rank chosen so
the stored factors take ``1 / reduction`` of the 16-bit cache) and, with ``match_unicache``, a
UniCache
row at the same KV bytes next to each (its target rate calibrated by bisection on the first
batch, :func:`unicache_train.eval.budget.rate_for_reduction`), so the two methods compare at
equal memory.

Each setting sums its measurements in one :class:`_Totals` over the batches; its means form a
:class:`Quality`, and :func:`quality_row` turns a setting, its quality and the uncompressed
reference into a table row (:data:`unicache_train.eval.report.CSV_COLUMNS`). Tables, CSVs, plots
and logger metrics: :mod:`unicache_train.eval.report`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from unicache_train.data.config import DataConfig
from unicache_train.eval.attn_kl import AttentionInputs, layer_kls
from unicache_train.eval.budget import measured_reduction, rate_for_reduction, unicache_at_rate
from unicache_train.eval.report import log_rows
from unicache_train.eval.synthetic_recall import recall_accuracy, synthetic_recall_records
from unicache_train.inloop import (
    compression_kl,
    continuation_mask,
    sample_splits,
    step_generator,
)
from unicache_train.model import Decoder
from unicache_train.model.loss import IGNORE_INDEX, masked_nll
from unicache_train.seam import (
    IdentityCompressor,
    KVCompressor,
    RecordingCompressor,
    pooled_kv_bytes,
)
from unicache_train.validation import ConfigError, check_choice, check_int, check_range

__all__ = [
    "CompressionEvalConfig",
    "Setting",
    "Quality",
    "quality_row",
    "evaluate_compression",
    "QUALITY_ATTN_KL_MAX",
    "QUALITY_PPL_INCREASE_MAX",
    "QUALITY_ACC_DROP_MAX",
]

#: Quality checks (the UniCache article §7.1; docs/architecture.md#quality-checks).
QUALITY_ATTN_KL_MAX = 0.1
QUALITY_PPL_INCREASE_MAX = 0.05
QUALITY_ACC_DROP_MAX = 0.05


@dataclass
class CompressionEvalConfig:
    """What :func:`evaluate_compression` measures (``unicache-train evaluate``'s ``sweep.*``
    fields).

    Attributes:
        rates: UniCache target rates to evaluate (fraction of context tokens removed).
        preset: UniCache preset the rates apply to; None: the checkpoint's ``compress.unicache``
            (its preset and overrides).
        quantize: ``"config"`` (as the preset/checkpoint says), ``"none"``, ``"int8"``,
            ``"int4"``.
        num_recall: recall prompts decoded per rate (0: skip recall).
        recall_seed: seed of those prompts (distinct from the training corpus' seed).
        limit_batches: validation batches for perplexity and KL.
        batch_size: prompts decoded together.
        attn_kl_layers: the last layers whose attention KL is measured.
        split_seed: seed of the random splits of samples without a data split.
        min_context: smallest random split (as ``CompressionTrainConfig.min_context``).
        out_dir: where the CSV and the PNG go.
        name: file stem of the CSV and PNG.
        xkv_reductions: KV reductions (uncompressed 16-bit bytes / stored bytes) at which xKV
            is evaluated (e.g. ``[4, 8]``); empty: no xKV rows. ``rates`` may then be empty.
        xkv: :class:`~unicache_train.compress.config.XKVConfig` fields of those rows (e.g.
            ``{"group_size": 4}``); ``rank_mode``/``reduction`` are set per row.
        xkv_token_rate: also evaluate UniCache token compression (at this rate, head merging
            and quantization off) followed by xKV at each reduction (``unicache+xkv`` rows);
            None: not.
        match_unicache: next to each xKV reduction, UniCache at the same KV bytes (rate
            calibrated by bisection on the first batch, quantization per ``quantize``).
    """

    rates: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.6])
    preset: str | None = None
    quantize: str = "config"
    num_recall: int = 64
    recall_seed: int = 9_999
    limit_batches: int = 8
    batch_size: int = 16
    attn_kl_layers: int = 2
    split_seed: int = 0
    min_context: int = 16
    out_dir: str = "eval_compress"
    name: str = "compression_eval"
    xkv_reductions: list[float] = field(default_factory=list)
    xkv: dict[str, Any] = field(default_factory=dict)
    xkv_token_rate: float | None = None
    match_unicache: bool = True

    def __post_init__(self) -> None:
        from unicache_train.compress.config import MAX_RATE, XKVConfig
        from unicache_train.compress.presets import PRESETS

        if not isinstance(self.xkv_reductions, (list, tuple)):
            raise ConfigError(
                f"CompressionEvalConfig.xkv_reductions={self.xkv_reductions!r}: expected a list "
                "of KV reductions in [1, 64]"
            )
        for r in self.xkv_reductions:
            XKVConfig(**{**self.xkv, "rank_mode": "reduction", "reduction": r})  # validates both
        if not self.xkv_reductions:
            XKVConfig(**self.xkv)
        self.xkv_reductions = [float(r) for r in self.xkv_reductions]
        if self.xkv_token_rate is not None:
            check_range(self, "xkv_token_rate", 0.0, MAX_RATE)
        if not isinstance(self.match_unicache, bool):
            raise ConfigError(
                f"CompressionEvalConfig.match_unicache={self.match_unicache!r}: expected a bool"
            )
        if not isinstance(self.rates, (list, tuple)) or not (self.rates or self.xkv_reductions):
            raise ConfigError(
                f"CompressionEvalConfig.rates={self.rates!r}: expected a non-empty list of rates"
                " (or give xkv_reductions)"
            )
        for r in self.rates:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= MAX_RATE:
                raise ConfigError(
                    f"CompressionEvalConfig.rates: {r!r} is out of range; allowed [0, {MAX_RATE}]"
                )
        self.rates = [float(r) for r in self.rates]
        if self.preset is not None:
            check_choice(self, "preset", tuple(PRESETS))
        check_choice(self, "quantize", ("config", "none", "int8", "int4"))
        check_int(self, "num_recall", 0)
        check_int(self, "recall_seed", 0)
        check_int(self, "limit_batches", 1)
        check_int(self, "batch_size", 1)
        check_int(self, "attn_kl_layers", 1)
        check_int(self, "split_seed", 0)
        check_int(self, "min_context", 1)


# --------------------------------------------------------------------------------- settings
@dataclass
class Setting:
    """One row of the sweep: its label, method, token rate, bits, compressor, and the KV
    reduction it was set up for (``target_reduction``; NaN for a plain UniCache rate).

    Attributes:
        compressor: None for the uncompressed reference (the plain forward).
    """

    label: str
    method: str
    rate: float
    bits: int | None
    compressor: KVCompressor | None = None
    target_reduction: float = math.nan


#: The reference row: the plain forward, full cache.
UNCOMPRESSED = Setting("uncompressed", "none", math.nan, None, None, 1.0)


def _batch_inputs(batch: dict[str, torch.Tensor], device, opts, batch_idx: int):
    """ids, labels, modality ids and the evaluation split of one perplexity batch."""
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    mods = batch.get("modality_ids")
    mods = mods.to(device) if mods is not None else None
    data_split = batch.get("split")
    split = sample_splits(
        labels,
        data_split.to(device) if data_split is not None else None,
        min_context=opts.min_context,
        generator=step_generator(opts.split_seed, batch_idx),
    )
    return ids, labels, mods, split


def _settings(
    model: Decoder,
    base_unicache: Any,
    opts: CompressionEvalConfig,
    first_batch: dict[str, torch.Tensor] | None,
) -> list[Setting]:
    """The compressed rows: UniCache at each rate; per xKV reduction: xKV, optionally UniCache
    tokens + xKV, optionally UniCache at the same bytes (calibrated on ``first_batch``)."""
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.compress.config import XKVConfig
    from unicache_train.compress.xkv import XKVCompressor
    from unicache_train.compress.xkv.compressor import token_config_for_xkv

    out = []
    for r in opts.rates:
        cfg = unicache_at_rate(base_unicache, r, opts.quantize)
        bits = cfg.quantize.bits if cfg.quantize.active else None
        label = f"rate={cfg.target_rate:g}" + (f" int{bits}" if bits else "")
        out.append(Setting(label, "unicache", cfg.target_rate, bits, UniCacheCompressor(cfg)))
    calib = None
    if opts.match_unicache and first_batch is not None and opts.xkv_reductions:
        device = next(model.parameters()).device
        ids, _, mods, split = _batch_inputs(first_batch, device, opts, 0)
        calib = (ids, split, mods)

    def unicache(rate: float) -> KVCompressor:
        return UniCacheCompressor(unicache_at_rate(base_unicache, rate, opts.quantize))

    for red in opts.xkv_reductions:
        xcfg = XKVConfig(**{**opts.xkv, "rank_mode": "reduction", "reduction": red})
        g = xcfg.group_size
        xkv = XKVCompressor(xcfg)
        out.append(Setting(f"xkv {red:g}x g{g}", "xkv", math.nan, None, xkv, red))
        if opts.xkv_token_rate is not None:
            plain = unicache_at_rate(base_unicache, opts.xkv_token_rate, "none")
            tok = UniCacheCompressor(token_config_for_xkv(plain))
            both = XKVCompressor(XKVConfig(**{**xcfg.to_dict(), "gradient": "exact"}), tok)
            label = f"unicache {opts.xkv_token_rate:g} + xkv {red:g}x g{g}"
            out.append(Setting(label, "unicache+xkv", opts.xkv_token_rate, None, both, red))
        if calib is not None:
            ids, split, mods = calib
            # NOTE: matched to the bytes xKV really stores on this batch (rank rounding keeps it
            # at or above the nominal reduction), not to the nominal one.
            target = measured_reduction(model, ids, split, xkv, mods)
            rate, _ = rate_for_reduction(
                model, ids, split, unicache, target, modality_ids=mods, iters=12
            )
            cfg = unicache_at_rate(base_unicache, rate, opts.quantize)
            bits = cfg.quantize.bits if cfg.quantize.active else None
            label = f"unicache @{red:g}x rate={rate:.3g}" + (f" int{bits}" if bits else "")
            uc = UniCacheCompressor(cfg)
            if measured_reduction(model, ids, split, uc, mods) < target / 1.02:
                # e.g. a modality cap (text 0.40 in the default preset) stops the rate
                label += " (cannot reach these bytes)"
            out.append(Setting(label, "unicache", rate, bits, uc, red))
    return out


# --------------------------------------------------------------------------------- measures
@dataclass
class Quality:
    """What one setting measured (defaults: the uncompressed model's own values).

    Attributes:
        ppl: perplexity on the continuation targets.
        recall_acc: exact-match recall accuracy (NaN: not measured).
        attn_kl: mean attention KL per query and head (NaN: not measured, e.g. MLA).
        output_kl: mean next-token KL per continuation target.
        kv_reduction: uncompressed 16-bit KV bytes / stored KV bytes.
        rate_realized: context tokens removed / context tokens, mean over layers and batches.
    """

    ppl: float
    recall_acc: float = math.nan
    attn_kl: float = 0.0
    output_kl: float = 0.0
    kv_reduction: float = 1.0
    rate_realized: float = 0.0


@dataclass
class _Totals:
    """One setting's sums over the perplexity batches (token-, query- or batch-weighted)."""

    attention: bool = True  # attention KL measured (GQA)
    nll: float = 0.0
    tokens: int = 0
    batches: int = 0
    output_kl: float = 0.0
    attn_kl: float = 0.0
    attn_queries: int = 0
    removed: float = 0.0  # sum over batches of the layers' mean rate_realized
    stored_bytes: float = 0.0
    baseline_bytes: float = 0.0

    def add_nll(self, logits: torch.Tensor, labels: torch.Tensor, cont: torch.Tensor) -> None:
        """logits [B, T, V], labels [B, T], cont [B, T] bool (continuation targets)."""
        s, n = masked_nll(logits, labels, cont)
        self.nll += float(s)
        self.tokens += int(n)
        self.batches += 1

    def add_compressed(
        self, out, plain: torch.Tensor, labels: torch.Tensor, cont: torch.Tensor
    ) -> None:
        """One compressed forward's output ``out`` against the plain logits [B, T, V]."""
        self.add_nll(out.logits, labels, cont)
        target = cont & (labels != IGNORE_INDEX)
        self.output_kl += float(compression_kl(plain, out.logits, target)) * int(target.sum())
        stats = out.compression_stats
        self.removed += sum(float(s["rate_realized"]) for s in stats) / max(len(stats), 1)
        kv, base = pooled_kv_bytes(stats)
        self.stored_bytes += float(kv)
        self.baseline_bytes += float(base)

    def add_attention(self, per_layer: Iterable[tuple[float, int]]) -> None:
        """(KL sum, queries x heads) per layer (:func:`~unicache_train.eval.attn_kl.layer_kls`)."""
        for kl, n in per_layer:
            self.attn_kl += kl
            self.attn_queries += n

    @property
    def ppl(self) -> float:
        """Perplexity of the summed NLL (capped at ``exp(50)``)."""
        return math.exp(min(self.nll / self.tokens, 50.0))

    def quality(self) -> Quality:
        """The means; the KV reduction from the compressor's own stats (recall overrides it
        with the real decoding caches' bytes)."""
        nan = math.nan
        reduction = self.baseline_bytes / self.stored_bytes if self.stored_bytes > 0 else nan
        return Quality(
            ppl=self.ppl,
            attn_kl=self.attn_kl / max(self.attn_queries, 1) if self.attention else nan,
            output_kl=self.output_kl / self.tokens,
            kv_reduction=reduction,
            rate_realized=self.removed / max(self.batches, 1),
        )


def quality_row(setting: Setting, q: Quality, reference: Quality) -> dict[str, Any]:
    """One table row (:data:`~unicache_train.eval.report.CSV_COLUMNS`) with
    its quality checks (True, False, or None = n/a) against the uncompressed ``reference``.

    A check reads n/a when it cannot measure anything: ``kl_ok`` without an attention KL (MLA),
    ``acc_ok`` without recall or when the uncompressed model recalls nothing (accuracy 0: no
    drop can show, so "at most 5 points lower" would pass whatever compression does). ``pass``
    is ``False`` if any check fails, else n/a if any is n/a, else ``True``.
    """
    ppl_delta = q.ppl / reference.ppl - 1.0
    acc_delta = q.recall_acc - reference.recall_acc
    kl_ok = None if math.isnan(q.attn_kl) else bool(q.attn_kl < QUALITY_ATTN_KL_MAX)
    ppl_ok = bool(ppl_delta <= QUALITY_PPL_INCREASE_MAX)
    acc_ok = (
        None
        if math.isnan(acc_delta) or reference.recall_acc == 0
        else bool(acc_delta >= -QUALITY_ACC_DROP_MAX)
    )
    checks = (kl_ok, ppl_ok, acc_ok)
    passed = False if False in checks else (None if None in checks else True)
    rate = setting.rate
    realized = q.rate_realized
    shortfall = max(rate - realized, 0.0) if not math.isnan(rate) else math.nan
    return {
        "label": setting.label,
        "rate": rate,
        "rate_realized": realized,
        "budget_shortfall": shortfall,
        "bits": setting.bits if setting.bits else "",
        "ppl": q.ppl,
        "ppl_uncompressed": reference.ppl,
        "ppl_delta": ppl_delta,
        "recall_acc": q.recall_acc,
        "recall_acc_uncompressed": reference.recall_acc,
        "recall_acc_delta": acc_delta,
        "attn_kl": q.attn_kl,
        "output_kl": q.output_kl,
        "kv_reduction": q.kv_reduction,
        "kl_ok": kl_ok,
        "ppl_ok": ppl_ok,
        "acc_ok": acc_ok,
        "pass": passed,
        "method": setting.method,
        "target_reduction": setting.target_reduction,
    }


# --------------------------------------------------------------------------------- main loop
@torch.no_grad()
def evaluate_compression(
    model: Decoder,
    tokenizer,
    data: DataConfig,
    base_unicache: Any,
    options: CompressionEvalConfig | None = None,
    *,
    logger: Any | None = None,
    loader: Iterable[dict[str, torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """Quality under compression at each rate and xKV reduction (see the module docstring).

    Args:
        model: the decoder (GQA; MLA without recall and attention KL; set to eval mode here).
        tokenizer: the data's tokenizer (recall prompts are encoded with it).
        data: data config of the perplexity batches (validation split) and of the recall task
            format (``data.synthetic``).
        base_unicache: the :class:`~unicache_train.compress.UniCacheConfig` the rates apply to.
        options: what to measure.
        logger: anything with ``log_metrics(dict, step)`` (a Lightning logger): one step per row.
        loader: perplexity batches (default: ``LMDataModule(data).val_dataloader()``).

    Returns:
        One dict per row (:func:`quality_row`): first ``uncompressed``, then one per setting
        (UniCache rates, then per xKV reduction: xKV, UniCache + xKV, UniCache at the same
        bytes).
    """
    opts = options or CompressionEvalConfig()
    model.eval()
    device = next(model.parameters()).device
    gqa = model.config.attention_type != "mla"
    kl_layers = min(opts.attn_kl_layers, model.config.num_hidden_layers) if gqa else 0

    if loader is None:
        from unicache_train.data.datamodule import LMDataModule

        dm = LMDataModule(data, tokenizer=tokenizer)
        dm.setup("validate")
        loader = dm.val_dataloader()
    batches = list(itertools.islice(iter(loader), opts.limit_batches))
    settings = _settings(model, base_unicache, opts, batches[0] if batches else None)
    plain = _Totals()
    totals = [_Totals(attention=gqa) for _ in settings]
    for batch_idx, batch in enumerate(batches):
        ids, labels, mods, split = _batch_inputs(batch, device, opts, batch_idx)
        cont = continuation_mask(split, ids.shape[1])
        qmask = (torch.arange(ids.shape[1], device=device)[None] >= split[:, None]) & (
            labels != IGNORE_INDEX
        )
        with AttentionInputs(model, kl_layers) as full:
            logits = model(ids, modality_ids=mods).logits
        plain.add_nll(logits, labels, cont)
        for st, tot in zip(settings, totals):
            seg = RecordingCompressor(st.compressor)
            with AttentionInputs(model, kl_layers) as comp:
                out = model(ids, modality_ids=mods, split=split, compressor=seg)
            tot.add_compressed(out, logits, labels, cont)
            tot.add_attention(
                layer_kls(model, full.inputs, comp.inputs, seg.segments, split, qmask)
            )
    if plain.tokens == 0:
        raise ValueError("evaluation saw no continuation targets: is the validation split empty?")

    # Recall on the real compressed cache (uncompressed = the identity compressor).
    records = []
    if opts.num_recall > 0 and gqa:
        records = synthetic_recall_records(data.synthetic, opts.num_recall, opts.recall_seed)
    reference = Quality(ppl=plain.ppl)
    if records:
        reference.recall_acc, _, _ = recall_accuracy(
            model, tokenizer, records, IdentityCompressor(), opts.batch_size
        )
    rows = [quality_row(UNCOMPRESSED, reference, reference)]
    for st, tot in zip(settings, totals):
        q = tot.quality()
        if records:
            q.recall_acc, q.kv_reduction, _ = recall_accuracy(
                model, tokenizer, records, st.compressor, opts.batch_size
            )
        rows.append(quality_row(st, q, reference))
    if logger is not None:
        log_rows(rows, logger)
    return rows
