"""Evaluation without a Trainer: perplexity, and quality under KV compression across rates.

Shape legend: B, H, Hk, T, M, D, V = batch, query heads, KV heads, tokens, segment entries, head
dim, vocab.

:func:`evaluate_compression` measures, for a model and a list of compression rates
(docs/architecture.md#quality-checks and #targets):

* **perplexity on continuations**, uncompressed and compressed, on the same tokens: each eval
  sample is split (the data's split, e.g. a recall answer, else a seeded random one, as in
  training); targets from position ``split - 1`` on count. Compressed = the in-loop forward
  (prefill, compress, continuation attends to the compressed cache), which equals decoding on
  the real compressed cache (``tests/test_inloop.py``).
* **key-value recall accuracy** on freshly generated recall prompts of the bundled task: greedy
  decoding of the answer **on the real compressed cache** (:func:`generate_compressed`: prefill,
  compress every layer, decode token by token), scored by exact match (:func:`score_recall`).
* **attention KL** (``compress/attn_kl``) on the last ``attn_kl_layers`` layers:
  ``KL(P_compressed || P_full)`` of each continuation query's attention over the original key
  tokens, mean over queries, heads and layers. ``P_full`` is the uncompressed forward's
  attention; ``P_compressed`` the compressed forward's, mapped back to tokens: a merged entry's
  probability is shared equally by the tokens it stands for (what its ``log(count)`` bias
  means), evicted tokens get 0. This direction is finite under eviction (the other one is
  infinite as soon as a full query looks at an evicted token) and still charges lost mass ``m``
  as ``-log(1 - m)``. Computed from hooks on the attention modules (the model is not modified).
* **output KL** (``compress/output_kl``): ``KL(p_full || p_compressed)`` of the next-token
  distributions on continuation targets.
* **KV bytes ratio**: bytes of the real compressed cache (packed int8/int4 + scales + merge
  counts / head maps) over the uncompressed 16-bit cache of the same prompts, all layers.
* **quality checks** (docs/architecture.md#quality-checks): ``kl_ok`` (attn KL < 0.1), ``ppl_ok``
  (perplexity at most +5%), ``acc_ok`` (recall accuracy at most 5 points lower), ``pass`` (all
  three). A check that cannot measure anything reads n/a (``None``): ``acc_ok`` when the
  uncompressed model recalls nothing, ``kl_ok`` without attention KL; ``pass`` is then n/a unless
  another check failed.
* **realized rate** (``rate_realized``): the fraction of context tokens really removed, next to
  the requested ``rate``, and their gap ``budget_shortfall`` (modality caps, protection).

Besides UniCache at each rate, ``xkv_ratios`` adds xKV rows (cross-layer SVD, rank chosen so the
stored factors take ``1 / ratio`` of the 16-bit cache) and, with ``match_unicache``, a UniCache
row at the same KV bytes next to each (its target rate calibrated by bisection on the first
batch), so the two methods compare at equal memory.

Outputs: :func:`format_table`, :func:`write_outputs` (CSV + PNG plot of perplexity and accuracy
against the rate) and logger metrics (``compress/ppl_delta``, ``compress/attn_kl``, ...).
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from unicache_train.compress.base import IdentityCompressor, KVCompressor, KVSegment
from unicache_train.config import ConfigError, DataConfig, _choice, _int, _range
from unicache_train.eval.budget import (
    measured_reduction,
    rate_for_reduction,
    stats_bytes,
    unicache_at_rate,
)
from unicache_train.model import Decoder
from unicache_train.train.compression import (
    IGNORE_INDEX,
    compression_kl,
    continuation_mask,
    masked_nll,
    sample_splits,
    step_generator,
)

__all__ = [
    "EvalResult",
    "evaluate_perplexity",
    "CompressionEvalConfig",
    "evaluate_compression",
    "unicache_at_rate",
    "recall_accuracy",
    "format_table",
    "write_outputs",
    "log_rows",
    "QUALITY_ATTN_KL_MAX",
    "QUALITY_PPL_INCREASE_MAX",
    "QUALITY_ACC_DROP_MAX",
    "CSV_COLUMNS",
]

#: Quality checks (the UniCache article §7.1; docs/architecture.md#quality-checks).
QUALITY_ATTN_KL_MAX = 0.1
QUALITY_PPL_INCREASE_MAX = 0.05
QUALITY_ACC_DROP_MAX = 0.05

#: ``rate``: the requested target rate; ``rate_realized``: the fraction of context tokens really
#: removed (``1 - keep_ratio``, mean over layers); ``budget_shortfall``: ``rate - rate_realized``
#: when positive (what modality caps, protection or the layer schedule withheld). The checks
#: read ``True``, ``False`` or ``None`` (n/a: not measurable, written ``n/a``).
CSV_COLUMNS = (
    "label", "rate", "rate_realized", "budget_shortfall", "bits", "ppl", "ppl_uncompressed",
    "ppl_delta", "recall_acc", "recall_acc_uncompressed", "recall_acc_delta", "attn_kl",
    "output_kl", "kv_bytes_ratio", "keep_ratio", "kl_ok", "ppl_ok", "acc_ok", "pass", "method",
)  # fmt: skip


@dataclass
class EvalResult:
    loss: float
    ppl: float
    tokens: int
    batches: int


@torch.no_grad()
def evaluate_perplexity(model: Decoder, loader, limit_batches: int | None = None) -> EvalResult:
    """Token-weighted mean next-token NLL and perplexity over ``loader``'s batches."""
    model.eval()
    device = next(model.parameters()).device
    nll, tokens, batches = 0.0, 0, 0
    for batch in loader:
        if limit_batches is not None and batches >= limit_batches:
            break
        ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        logits = model(ids, modality_ids=batch.get("modality_ids", None)).logits
        nll += F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ).item()
        tokens += int((labels != IGNORE_INDEX).sum())
        batches += 1
    if tokens == 0:
        raise ValueError("evaluation saw no target tokens: is the validation split empty?")
    loss = nll / tokens
    return EvalResult(loss=loss, ppl=math.exp(min(loss, 50.0)), tokens=tokens, batches=batches)


# --------------------------------------------------------------------------------- options
@dataclass
class CompressionEvalConfig:
    """What :func:`evaluate_compression` measures (the ``--compression.*`` CLI options).

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
        xkv_ratios: KV-bytes reductions at which xKV is evaluated (e.g. ``[4, 8]``); empty:
            no xKV rows. ``rates`` may then be empty.
        xkv: :class:`~unicache_train.compress.config.XKVConfig` fields of those rows (e.g.
            ``{"group_size": 4}``); ``rank_mode``/``ratio`` are set per row.
        xkv_token_rate: also evaluate UniCache token compression (at this rate, head merging
            and quantization off) followed by xKV at each ratio (``unicache+xkv`` rows);
            None: not.
        match_unicache: next to each xKV ratio, UniCache at the same KV bytes (rate
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
    xkv_ratios: list[float] = field(default_factory=list)
    xkv: dict[str, Any] = field(default_factory=dict)
    xkv_token_rate: float | None = None
    match_unicache: bool = True

    def __post_init__(self) -> None:
        from unicache_train.compress.config import MAX_RATE, XKVConfig
        from unicache_train.compress.presets import PRESETS

        if not isinstance(self.xkv_ratios, (list, tuple)):
            raise ConfigError(
                f"CompressionEvalConfig.xkv_ratios={self.xkv_ratios!r}: expected a list of "
                "KV-bytes reductions in [1, 64]"
            )
        for r in self.xkv_ratios:
            XKVConfig(**{**self.xkv, "rank_mode": "ratio", "ratio": r})  # validates both
        if not self.xkv_ratios:
            XKVConfig(**self.xkv)
        self.xkv_ratios = [float(r) for r in self.xkv_ratios]
        if self.xkv_token_rate is not None:
            _range(self, "xkv_token_rate", 0.0, MAX_RATE)
        if not isinstance(self.match_unicache, bool):
            raise ConfigError(
                f"CompressionEvalConfig.match_unicache={self.match_unicache!r}: expected a bool"
            )
        if not isinstance(self.rates, (list, tuple)) or not (self.rates or self.xkv_ratios):
            raise ConfigError(
                f"CompressionEvalConfig.rates={self.rates!r}: expected a non-empty list of rates"
                " (or give xkv_ratios)"
            )
        for r in self.rates:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= MAX_RATE:
                raise ConfigError(
                    f"CompressionEvalConfig.rates: {r!r} is out of range; allowed [0, {MAX_RATE}]"
                )
        self.rates = [float(r) for r in self.rates]
        if self.preset is not None:
            _choice(self, "preset", tuple(PRESETS))
        _choice(self, "quantize", ("config", "none", "int8", "int4"))
        _int(self, "num_recall", 0)
        _int(self, "recall_seed", 0)
        _int(self, "limit_batches", 1)
        _int(self, "batch_size", 1)
        _int(self, "attn_kl_layers", 1)
        _int(self, "split_seed", 0)
        _int(self, "min_context", 1)


# unicache_at_rate lives in unicache_train.eval.budget (imported above, re-exported).


# --------------------------------------------------------------------------------- attention KL
class _AttnCapture:
    """Forward pre-hooks on the last layers' attention: keep their inputs (normalised hidden
    states and RoPE tables) so that attention probabilities can be recomputed afterwards."""

    def __init__(self, model: Decoder, num_layers: int) -> None:
        layers = list(model.layers)[-num_layers:]
        self.inputs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.handles = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in layers
        ]

    def _hook(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs["x"]
        self.inputs[module.layer_idx] = (x.detach(), kwargs["rope"])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _SegmentCapture:
    """Wraps a compressor; keeps each layer's segment."""

    def __init__(self, inner: KVCompressor) -> None:
        self.inner = inner
        self.pre_rope = bool(getattr(inner, "pre_rope", False))
        self.segments: dict[int, KVSegment] = {}

    def __call__(self, inp) -> KVSegment:
        seg = self.inner(inp)
        self.segments[inp.layer_idx] = seg
        return seg


def _qk(attn, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rot [B, H, T, D], k_rot [B, Hk, T, D] in fp32, from the attention module itself
    (:meth:`~unicache_train.model.attention.Attention.project`: q/k norms and RoPE included)."""
    qkv = attn.project(x, rope)
    return qkv.q.float(), qkv.k.float()


def _attn_kl_layer(
    attn, full_in, comp_in, seg: KVSegment, split: torch.Tensor, query_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ``KL(P_comp || P_full)`` over masked continuation queries x heads, and the count.

    Args:
        full_in, comp_in: (x [B, T, C], rope) of the uncompressed / compressed forward.
        seg: the layer's segment (keys [B, Hk, M, D], counts/valid [B, M], assignment [B, T]).
        split: [B].
        query_mask: [B, T] bool, continuation queries that count.
    """
    from unicache_train.model.attention import segment_attention_mask

    q_f, k_f = _qk(attn, *full_in)
    q_c, k_c = _qk(attn, *comp_in)
    B, H, T, D = q_f.shape
    rep = H // k_f.shape[1]
    scale = D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q_f.device).tril()
    logits_f = (q_f @ k_f.repeat_interleave(rep, 1).transpose(-1, -2)) * scale  # [B, H, T, T]
    p_full = torch.softmax(logits_f.masked_fill(~causal, float("-inf")), -1)
    keys_c = torch.cat([seg.keys.float(), k_c], 2).repeat_interleave(rep, 1)  # [B, H, M + T, D]
    mask = segment_attention_mask(seg, split, T, torch.float32)  # [B, 1, T, M + T]
    p_comp = torch.softmax((q_c @ keys_c.transpose(-1, -2)) * scale + mask, -1)
    M = seg.keys.shape[2]
    # Entries back to tokens: a token's share of its entry is 1/count; evicted tokens get 0.
    assign = seg.assignment
    if assign is None:  # identity layout: entry m is token m
        t = torch.arange(T, device=split.device).expand(B, T)
        assign = torch.where(seg.valid if M == T else t < split[:, None], t, -1)
    ok = assign >= 0  # [B, T] context token kept or merged
    idx = assign.clamp_min(0)
    counts = seg.counts.float().clamp_min(1.0).gather(1, idx)  # [B, T]
    ent = p_comp[..., :M].gather(-1, idx[:, None, None, :].expand(B, H, T, T))  # [B, H, Tq, Tk]
    ctx_key = torch.arange(T, device=split.device)[None, :] < split[:, None]  # [B, T] key side
    tok_ctx = torch.where((ok & ctx_key)[:, None, None, :], ent / counts[:, None, None, :], 0.0)
    tok_cont = torch.where(ctx_key[:, None, None, :], 0.0, p_comp[..., M:])
    p_tok = tok_ctx + tok_cont  # [B, H, T, T] compressed attention on original tokens
    kl = torch.where(
        p_tok > 0, p_tok * (p_tok.clamp_min(1e-30).log() - p_full.clamp_min(1e-30).log()), 0.0
    ).sum(-1)
    qm = query_mask[:, None, :].expand(B, H, T)
    return kl[qm].sum(), qm.sum()


# --------------------------------------------------------------------------------- recall
@torch.no_grad()
def recall_accuracy(
    model: Decoder,
    tokenizer,
    records: Sequence[dict[str, Any]],
    compressor: KVCompressor,
    batch_size: int = 16,
) -> tuple[float, float, list[str]]:
    """Greedy answers decoded on the compressed cache; exact-match accuracy.

    Args:
        records: dicts with ``prompt`` (ends before the answer) and ``answer``
            (:func:`unicache_train.data.synthetic.recall_examples`).

    Returns:
        (accuracy in [0, 1], KV bytes ratio of the compressed prompt caches, predictions).
    """
    from unicache_train.compress.inference import generate_compressed
    from unicache_train.data.synthetic import score_recall

    device = next(model.parameters()).device
    preds: list[str] = []
    kv, base = 0, 0
    hd = model.config.head_size
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        prompts = [tokenizer.encode(r["prompt"], add_bos=True) for r in chunk]
        n_new = max(len(tokenizer.encode(r["answer"])) for r in chunk) + 1
        P = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), P), tokenizer.pad_token_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        split = torch.tensor([len(p) for p in prompts])
        gen = generate_compressed(
            model,
            ids.to(device),
            split.to(device),
            compressor,
            n_new,
            eos_token_id=tokenizer.eos_token_id,
        )
        preds += [tokenizer.decode(row.tolist()) for row in gen.tokens]
        kv += gen.cache.kv_bytes()
        base += gen.cache.baseline_bytes(hd)
    acc = score_recall(preds, [r["answer"] for r in records])
    return acc, kv / max(base, 1), preds


# --------------------------------------------------------------------------------- main loop
@dataclass
class _Setting:
    """One compressed row of the evaluation: its label, method, token rate, bits, compressor,
    and the KV-bytes reduction it was set up for (xKV ratio; NaN for a plain UniCache rate)."""

    label: str
    method: str
    rate: float
    bits: int | None
    compressor: KVCompressor
    target: float = math.nan


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


def _measured_ratio(
    model: Decoder, batch: dict[str, torch.Tensor], comp: KVCompressor, opts
) -> float:
    """Stored KV bytes / 16-bit bytes of one in-loop forward of ``comp`` on ``batch``."""
    device = next(model.parameters()).device
    ids, _, mods, split = _batch_inputs(batch, device, opts, 0)
    return 1.0 / measured_reduction(model, ids, split, comp, mods)


def unicache_rate_for_bytes(
    model: Decoder,
    batch: dict[str, torch.Tensor],
    base_unicache: Any,
    kv_bytes_ratio: float,
    quantize: str = "config",
    *,
    opts: CompressionEvalConfig | None = None,
    iters: int = 12,
) -> float:
    """The UniCache target rate whose stored KV bytes (stats of one in-loop forward on
    ``batch``) are at most ``kv_bytes_ratio`` of the 16-bit cache: the smallest such rate by
    bisection on ``[0, MAX_RATE]`` (:func:`unicache_train.eval.budget.rate_for_reduction`).
    MAX_RATE if none reaches it.
    """
    from unicache_train.compress import UniCacheCompressor

    device = next(model.parameters()).device
    ids, _, mods, split = _batch_inputs(batch, device, opts or CompressionEvalConfig(), 0)

    def build(rate: float) -> KVCompressor:
        return UniCacheCompressor(unicache_at_rate(base_unicache, rate, quantize))

    rate, _ = rate_for_reduction(
        model, ids, split, build, 1.0 / kv_bytes_ratio, modality_ids=mods, iters=iters
    )
    return rate


def _settings(
    model: Decoder,
    base_unicache: Any,
    opts: CompressionEvalConfig,
    first_batch: dict[str, torch.Tensor] | None,
) -> list[_Setting]:
    """The compressed rows: UniCache at each rate; per xKV ratio: xKV, optionally UniCache
    tokens + xKV, optionally UniCache at the same bytes."""
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.compress.config import UniCacheConfig, XKVConfig
    from unicache_train.compress.xkv import XKVCompressor

    out = []
    for r in opts.rates:
        cfg = unicache_at_rate(base_unicache, r, opts.quantize)
        bits = cfg.quantize.bits if cfg.quantize.active else None
        label = f"rate={cfg.target_rate:g}" + (f" int{bits}" if bits else "")
        out.append(_Setting(label, "unicache", cfg.target_rate, bits, UniCacheCompressor(cfg)))
    for ratio in opts.xkv_ratios:
        xcfg = XKVConfig(**{**opts.xkv, "rank_mode": "ratio", "ratio": ratio})
        g = xcfg.group_size
        xkv = XKVCompressor(xcfg)
        out.append(_Setting(f"xkv {ratio:g}x g{g}", "xkv", math.nan, None, xkv, ratio))
        if opts.xkv_token_rate is not None:
            d = unicache_at_rate(base_unicache, opts.xkv_token_rate, "none").to_dict()
            d["head_merge"]["enabled"] = False
            tok = UniCacheCompressor(UniCacheConfig.from_dict(d))
            both = XKVCompressor(XKVConfig(**{**xcfg.to_dict(), "gradient": "exact"}), tok)
            label = f"unicache {opts.xkv_token_rate:g} + xkv {ratio:g}x g{g}"
            out.append(_Setting(label, "unicache+xkv", opts.xkv_token_rate, None, both, ratio))
        if opts.match_unicache and first_batch is not None:
            # NOTE: matched to the bytes xKV really stores on this batch (rank rounding keeps it
            # at or below 1 / ratio), not to the nominal ratio.
            target = _measured_ratio(model, first_batch, xkv, opts)
            rate = unicache_rate_for_bytes(
                model, first_batch, base_unicache, target, opts.quantize, opts=opts
            )
            cfg = unicache_at_rate(base_unicache, rate, opts.quantize)
            bits = cfg.quantize.bits if cfg.quantize.active else None
            label = f"unicache @{ratio:g}x rate={rate:.3g}" + (f" int{bits}" if bits else "")
            uc = UniCacheCompressor(cfg)
            if _measured_ratio(model, first_batch, uc, opts) > 1.02 * target:
                # e.g. a modality cap (text 0.40 in the default preset) stops the rate
                label += " (cannot reach these bytes)"
            out.append(_Setting(label, "unicache", rate, bits, uc, ratio))
    return out


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
    """Quality under compression at each rate and xKV ratio (see the module docstring).

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
        One dict per row with :data:`CSV_COLUMNS` (plus ``kv_target``, the reduction an xKV or
        matched row was set up for): first ``uncompressed``, then one per setting (UniCache
        rates, then per xKV ratio: xKV, UniCache + xKV, UniCache at the same bytes).
    """
    opts = options or CompressionEvalConfig()
    model.eval()
    device = next(model.parameters()).device
    n_layers = min(opts.attn_kl_layers, model.config.num_hidden_layers)
    gqa = model.config.attention_type != "mla"

    if loader is None:
        from unicache_train.data.datamodule import LMDataModule

        dm = LMDataModule(data, tokenizer=tokenizer)
        dm.setup("validate")
        loader = dm.val_dataloader()
    batches = list(itertools.islice(iter(loader), opts.limit_batches))
    settings = _settings(model, base_unicache, opts, batches[0] if batches else None)
    comps = [st.compressor for st in settings]
    R = len(comps)
    nll_plain = 0.0
    nll = [0.0] * R
    out_kl = [0.0] * R
    attn_kl = [0.0] * R
    attn_n = [0] * R
    keep = [0.0] * R
    stat_kv = [0.0] * R
    stat_base = [0.0] * R
    tokens = 0
    n_batches = 0
    for batch_idx, batch in enumerate(batches):
        ids, labels, mods, split = _batch_inputs(batch, device, opts, batch_idx)
        cont = continuation_mask(split, ids.shape[1])
        target = cont & (labels != IGNORE_INDEX)
        qmask = (torch.arange(ids.shape[1], device=device)[None] >= split[:, None]) & (
            labels != IGNORE_INDEX
        )
        cap_full = _AttnCapture(model, n_layers) if gqa else None
        try:
            plain = model(ids, modality_ids=mods).logits
        finally:
            full_inputs = cap_full.inputs if cap_full is not None else {}
            if cap_full is not None:
                cap_full.remove()
        s, n = masked_nll(plain, labels, cont)
        nll_plain += float(s)
        tokens += int(n)
        n_batches += 1
        for i, comp in enumerate(comps):
            seg_cap = _SegmentCapture(comp)
            cap = _AttnCapture(model, n_layers) if gqa else None
            try:
                out = model(ids, modality_ids=mods, split=split, compressor=seg_cap)
            finally:
                if cap is not None:
                    cap.remove()
            nll[i] += float(masked_nll(out.logits, labels, cont)[0])
            out_kl[i] += float(compression_kl(plain, out.logits, target)) * int(target.sum())
            keep[i] += float(
                sum(float(s["keep_ratio"]) for s in out.compression) / max(len(out.compression), 1)
            )
            kv, base = stats_bytes(out.compression)
            stat_kv[i] += kv
            stat_base[i] += base
            if cap is not None:
                for layer_idx, comp_in in cap.inputs.items():
                    attn = model.layers[layer_idx].self_attn
                    k, c = _attn_kl_layer(
                        attn,
                        full_inputs[layer_idx],
                        comp_in,
                        seg_cap.segments[layer_idx],
                        split,
                        qmask,
                    )
                    attn_kl[i] += float(k)
                    attn_n[i] += int(c)
    if tokens == 0:
        raise ValueError("evaluation saw no continuation targets: is the validation split empty?")

    # Recall on the real compressed cache (uncompressed = the identity compressor).
    records: list[dict[str, Any]] = []
    if opts.num_recall > 0:
        from unicache_train.data.synthetic import recall_examples

        sc = data.synthetic
        records = list(
            recall_examples(
                opts.num_recall,
                opts.recall_seed,
                sc.recall_num_facts,
                sc.recall_num_questions,
                sc.recall_num_filler,
            )
        )
    nan = float("nan")
    acc_plain = nan
    if records and gqa:
        acc_plain, _, _ = recall_accuracy(
            model, tokenizer, records, IdentityCompressor(), opts.batch_size
        )
    ppl_plain = math.exp(min(nll_plain / tokens, 50.0))
    rows: list[dict[str, Any]] = [
        _row(
            "uncompressed",
            nan,
            None,
            ppl_plain,
            ppl_plain,
            acc_plain,
            acc_plain,
            0.0,
            0.0,
            1.0,
            1.0,
        )
    ]
    rows[0]["method"] = "none"
    rows[0]["kv_target"] = 1.0
    for i, st in enumerate(settings):
        acc = nan
        # Without recall: the compressor's own byte accounting on the perplexity batches.
        ratio = stat_kv[i] / stat_base[i] if stat_base[i] > 0 else nan
        if records and gqa:
            acc, ratio, _ = recall_accuracy(
                model, tokenizer, records, st.compressor, opts.batch_size
            )
        row = _row(
            st.label,
            st.rate,
            st.bits,
            math.exp(min(nll[i] / tokens, 50.0)),
            ppl_plain,
            acc,
            acc_plain,
            attn_kl[i] / max(attn_n[i], 1) if gqa else nan,
            out_kl[i] / tokens,
            ratio,
            keep[i] / max(n_batches, 1),
        )
        row["method"] = st.method
        row["kv_target"] = st.target
        rows.append(row)
    if logger is not None:
        log_rows(rows, logger)
    return rows


def _row(
    label: str,
    rate: float,
    bits: int | None,
    ppl: float,
    ppl_plain: float,
    acc: float,
    acc_plain: float,
    attn_kl: float,
    output_kl: float,
    kv_ratio: float,
    keep_ratio: float,
) -> dict[str, Any]:
    """One table row with its quality checks (True, False, or None = n/a).

    A check reads n/a when it cannot measure anything: ``kl_ok`` without an attention KL (MLA),
    ``acc_ok`` without recall or when the uncompressed model recalls nothing (accuracy 0: no
    drop can show, so "at most 5 points lower" would pass whatever compression does). ``pass``
    is ``False`` if any check fails, else n/a if any is n/a, else ``True``.
    """
    ppl_delta = ppl / ppl_plain - 1.0
    acc_delta = acc - acc_plain
    kl_ok = None if math.isnan(attn_kl) else bool(attn_kl < QUALITY_ATTN_KL_MAX)
    ppl_ok = bool(ppl_delta <= QUALITY_PPL_INCREASE_MAX)
    acc_ok = (
        None
        if math.isnan(acc_delta) or acc_plain == 0
        else bool(acc_delta >= -QUALITY_ACC_DROP_MAX)
    )
    checks = (kl_ok, ppl_ok, acc_ok)
    passed = False if False in checks else (None if None in checks else True)
    realized = 1.0 - keep_ratio
    shortfall = max(rate - realized, 0.0) if not math.isnan(rate) else math.nan
    return {
        "label": label, "rate": rate, "rate_realized": realized, "budget_shortfall": shortfall,
        "bits": bits if bits else "", "ppl": ppl,
        "ppl_uncompressed": ppl_plain, "ppl_delta": ppl_delta, "recall_acc": acc,
        "recall_acc_uncompressed": acc_plain, "recall_acc_delta": acc_delta, "attn_kl": attn_kl,
        "output_kl": output_kl, "kv_bytes_ratio": kv_ratio, "keep_ratio": keep_ratio,
        "kl_ok": kl_ok, "ppl_ok": ppl_ok, "acc_ok": acc_ok, "pass": passed,
    }  # fmt: skip


def _check_value(check: bool | None) -> float:
    """A check as a logged number: 1 pass, 0 fail, NaN n/a."""
    return math.nan if check is None else float(check)


# --------------------------------------------------------------------------------- outputs
def log_rows(rows: Sequence[dict[str, Any]], logger: Any) -> None:
    """Rows to a logger under the ``compress/`` names, one logger step per compressed row."""
    for step, row in enumerate(r for r in rows if r["label"] != "uncompressed"):
        metrics = {
            "compress/rate": row["rate"],
            "compress/ppl": row["ppl"],
            "compress/ppl_delta": row["ppl_delta"],
            "compress/recall_acc": row["recall_acc"],
            "compress/recall_acc_delta": row["recall_acc_delta"],
            "compress/attn_kl": row["attn_kl"],
            "compress/output_kl": row["output_kl"],
            "compress/kv_bytes_ratio": row["kv_bytes_ratio"],
            "compress/keep_ratio": row["keep_ratio"],
            "compress/rate_realized": row["rate_realized"],
            "compress/budget_shortfall": row["budget_shortfall"],
            "compress/pass": _check_value(row["pass"]),
        }
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
    if hasattr(logger, "save"):
        logger.save()


def _fmt(value: Any) -> str:
    if value is None:  # a check that could not be measured
        return "n/a"
    if isinstance(value, bool):
        return "PASS" if value else "fail"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A fixed-width text table of the rows (default columns: the ones a reader compares)."""
    cols = list(
        columns
        or (
            "label",
            "rate",
            "rate_realized",
            "budget_shortfall",
            "ppl",
            "ppl_delta",
            "recall_acc",
            "attn_kl",
            "output_kl",
            "keep_ratio",
            "kv_bytes_ratio",
            "kl_ok",
            "ppl_ok",
            "acc_ok",
            "pass",
        )
    )
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_outputs(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, name: str = "compression_eval"
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.csv`` (:data:`CSV_COLUMNS`) and ``<name>.png`` (perplexity and
    recall accuracy against the rate, uncompressed as dashed lines, KV reduction annotated)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / f"{name}.csv", out / f"{name}.png"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "n/a" if v is None else v for k, v in r.items()})
    _plot(rows, png_path)
    return csv_path, png_path


def _plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported; no display on servers and CI
    import matplotlib.pyplot as plt

    comp = [r for r in rows if r["label"] != "uncompressed" and not math.isnan(r["rate"])]
    comp = sorted(comp, key=lambda r: r["rate"])
    base = next((r for r in rows if r["label"] == "uncompressed"), None)
    by_bytes = any(r.get("method", "unicache") not in ("unicache", "none") for r in rows)
    fig, axes = plt.subplots(1, 3 if by_bytes else 2, figsize=(15 if by_bytes else 10, 4))
    x = [r["rate"] for r in comp]
    for ax, key, title in (
        (axes[0], "ppl", "perplexity on continuations"),
        (axes[1], "recall_acc", "key-value recall accuracy"),
    ):
        ax.plot(x, [r[key] for r in comp], "o-", label="UniCache")
        if base is not None and not math.isnan(base[key]):
            ax.axhline(base[key], ls="--", color="gray", label="uncompressed")
        for r in comp:
            ratio = r["kv_bytes_ratio"]
            if not math.isnan(r[key]) and not math.isnan(ratio) and ratio > 0:
                ax.annotate(
                    f"{1 / ratio:.1f}x",
                    (r["rate"], r[key]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xlabel("UniCache target rate (fraction of context tokens removed)")
        ax.set_title(title)
        ax.legend()
    axes[1].set_ylim(-0.02, 1.02)
    if by_bytes:
        ax = axes[2]
        methods = sorted({r.get("method", "unicache") for r in rows} - {"none"})
        for m in methods:
            pts = sorted(
                (1 / r["kv_bytes_ratio"], r["ppl"])
                for r in rows
                if r.get("method", "unicache") == m and r["kv_bytes_ratio"] > 0
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
        if base is not None:
            ax.axhline(base["ppl"], ls="--", color="gray", label="uncompressed")
        ax.set_xlabel("KV bytes reduction (x, stored bytes incl. factors / scales)")
        ax.set_title("perplexity at equal KV bytes")
        ax.legend()
    fig.suptitle("quality under KV compression (annotations: KV bytes reduction)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
