"""Validated configuration of the UniCache compressor (docs/architecture.md#unicache-pipeline).

One dataclass per pipeline step; :class:`UniCacheConfig` holds them plus the global target, the
curriculum ``rate_scale`` and the cache dtype used by the byte accounting. Defaults are the UniCache
article's unless a field says otherwise, and where the article recommends a range that range is
enforced, so a value outside it raises :class:`~unicache_train.validation.ConfigError` naming
the field, the value and the allowed range. The step classes (``HeadMerge``, ``Importance``,
...) subclass these dataclasses, so a method's fields *are* its hyperparameters.

Rate convention (UniCache article §4.3, §5.2, §5.3, §7.2): a **compression rate** is the fraction of
context tokens *removed* (evicted or merged away): 0 keeps everything, 0.75 keeps a quarter. The
article's "shallow 75% / deep 45%" (deep layers are protected), "visual cap 80% / text cap 40%"
(caps stop a modality from being crushed), "alignment tokens: others 60%, they only 30%" and "higher
complexity -> lower rate" are all consistent only with this reading. Bytes are compared as a
**reduction**, uncompressed 16-bit bytes / stored bytes (``XKVConfig.reduction``, the
``kv_reduction`` stat); docs/architecture.md#words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from unicache_train.validation import (
    ConfigBase,
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_nested,
    check_range,
)

__all__ = [
    "HeadMergeConfig",
    "ImportanceConfig",
    "ScheduleConfig",
    "BudgetConfig",
    "ProtectConfig",
    "MergeEvictConfig",
    "QuantizeConfig",
    "FallbackConfig",
    "SelectionConfig",
    "UniCacheConfig",
    "XKVConfig",
    "MAX_RATE",
    "MERGE_RESCALE_RULES",
    "SELECTION_METHODS",
    "RETENTION_RELAXATIONS",
    "GLOBAL_BUDGET_METHODS",
]

#: No layer or modality ever removes more than this fraction (a cache must keep something).
MAX_RATE = 0.95

#: Selections whose scores compare across layers (``ScheduleConfig.global_budget``): the learned
#: scorer predicts the log attention a token receives, SnapKV measures the attention mass.
GLOBAL_BUDGET_METHODS = ("attention", "snapkv")

#: Which averages of a merged entry are rescaled to their members' mean norm (MergeEvictConfig).
MERGE_RESCALE_RULES = ("k", "kv", "none")


def _optional_rate(obj: Any, name: str, hi: float) -> None:
    if getattr(obj, name) is not None:
        check_range(obj, name, 0.0, hi)


@dataclass
class HeadMergeConfig(ConfigBase):
    """Head merging (UniCache article §3.2): KV heads of a layer whose context K/V are similar are
    averaged into one stored copy per group.

    Attributes:
        enabled: run this step.
        threshold: cosine similarity a head must *exceed* with every member of a group to join
            it (source: 0.85-0.92, default 0.88).
        similarity: ``"keys"``: cosine of the heads' flattened context keys; ``"kv"``: the
            smaller of the key cosine and the value cosine (stricter: K and V must both agree).
    """

    enabled: bool = True
    threshold: float = 0.88
    similarity: str = "keys"

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_range(self, "threshold", 0.85, 0.92)
        check_choice(self, "similarity", ("keys", "kv"))


@dataclass
class ImportanceConfig(ConfigBase):
    """Token importance ``s = w_a*a + w_c*c - w_d*d + w_r*r`` (UniCache article §2.3, §4.2, §4.3).

    Attributes:
        enabled: run this step (without it every token scores 0: selection by position only).
        window: W, the number of last context queries whose attention is observed (a, c).
        w_a, w_c, w_d, w_r: weights of attention, cross-modal, redundancy, recency.
        shallow_w_d: w_d in the shallow third of the layers (``3*layer < num_layers``).
        deep_w_a: w_a in the deep third (``3*layer >= 2*num_layers``).
        neighbours: k, neighbours on each side compared for redundancy (source: 4-8).
        frame_stride: if > ``neighbours``, the tokens ``j * frame_stride`` before/after for
            ``j = 1..neighbours`` (the same patch in the previous/next frames of a video) are
            neighbours too (long-video preset: patches per frame).
        similarity: ``"keys"`` (cosine of keys) or ``"kv"`` (mean of key and value cosines).
        normalize: ``"modality"`` (a and c normalized within each modality, the method) or
            ``"global"`` (over all context tokens: the text-style baseline; the article §2.3 warns
            that it makes the model "read the text and ignore the image").
        pool: span pooling of the score: each token takes the max score of the ``pool``
            tokens centred on it (same modality, context only), so the neighbours of an
            important token are kept with it and spans survive whole (a number split into
            single-digit tokens, say); 0 or 1: no pooling; otherwise odd, at most 63. SnapKV
            (arXiv 2404.14469) pools its attention scores the same way.
    """

    enabled: bool = True
    window: int = 32
    w_a: float = 0.4
    w_c: float = 0.3
    w_d: float = 0.2
    w_r: float = 0.1
    shallow_w_d: float = 0.3
    deep_w_a: float = 0.5
    neighbours: int = 4
    frame_stride: int = 0
    similarity: str = "keys"
    normalize: str = "modality"
    pool: int = 0

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_int(self, "window", 1, 4096)
        check_int(self, "pool", 0, 63)
        if self.pool > 1 and self.pool % 2 == 0:
            raise ConfigError(
                f"ImportanceConfig.pool={self.pool!r} must be odd (a window centred on the "
                "token), 0 or 1; allowed 0, 1, 3, 5, ..., 63"
            )
        for name in ("w_a", "w_c", "w_d", "w_r", "shallow_w_d", "deep_w_a"):
            check_range(self, name, 0.0, 1.0)
        check_int(self, "neighbours", 4, 8)
        check_int(self, "frame_stride", 0, 1 << 20)
        check_choice(self, "similarity", ("keys", "kv"))
        check_choice(self, "normalize", ("modality", "global"))


@dataclass
class ScheduleConfig(ConfigBase):
    """Per-layer rate on a cosine curve shallow -> deep (UniCache article §4.3, §9 pitfall 4).

    The curve goes from ``shallow_rate`` (layer 0) through their mean (middle layer) to
    ``deep_rate`` (last layer); it is then scaled so that its mean over layers equals the
    target rate (with the defaults and target 0.6: exactly 0.75 -> 0.60 -> 0.45).

    Attributes:
        enabled: run this step (without it every layer gets the target rate).
        shallow_rate: rate of the first layer at the reference target.
        deep_rate: rate of the last layer at the reference target.
        global_budget: one budget over all layers instead (KVzip's): the target rate applies to
            the context tokens of all layers together, and each layer's rate is what a single
            ranking of the selection's scores over every layer's tokens leaves it
            (:mod:`~unicache_train.compress.global_budget`). The compressor then needs every
            layer's context before it compresses any (the decoder's recording pass, as xKV's).
            Needs ``enabled=False`` (the ranking replaces the curve) and a selection whose
            scores compare across layers (``selection.method`` ``"attention"`` or
            ``"snapkv"``).
    """

    enabled: bool = True
    shallow_rate: float = 0.75
    deep_rate: float = 0.45
    global_budget: bool = False

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_bool(self, "global_budget")
        check_range(self, "shallow_rate", 0.0, MAX_RATE)
        check_range(self, "deep_rate", 0.0, MAX_RATE)
        if self.global_budget and self.enabled:
            raise ConfigError(
                "ScheduleConfig.global_budget=True is not allowed with enabled=True: the ranking "
                "over all layers decides each layer's rate, the cosine curve would too; set "
                "schedule.enabled=False"
            )
        if self.shallow_rate + self.deep_rate == 0:
            raise ConfigError(
                "ScheduleConfig.shallow_rate + deep_rate must be > 0 (the curve is scaled to "
                "the target by its mean)"
            )


@dataclass
class BudgetConfig(ConfigBase):
    """Modality budgets from information density (UniCache article §5.2).

    Attributes:
        enabled: run this step (without it every modality gets the layer rate: uniform).
        text_cap, vision_cap, audio_cap: the most a modality may lose (source: visual 0.80,
            text 0.40). Audio (not in the source) defaults to 0.60: speech frames are far more
            redundant than text tokens, but carry words, so it sits between the two.
        text_rate, vision_rate, audio_rate: optional fixed rates (presets). A fixed rate is the
            rate at the reference ``target_rate`` and follows the layer curve
            (``fixed * layer_rate / target_rate``); the other modalities share the rest.
        density_floor: smallest density used (a modality of identical tokens has density 0).
        allocation: ``"density"`` (the method: rates inversely proportional to density, capped)
            or ``"pooled"`` (what a text KV method's global top-k does: every context token of a
            sample competes in one ranking of the importance scores, and each modality loses
            the tokens it has among the lowest ``R * N``; no caps, no fixed rates). Pooled
            selection exists as a baseline (``presets.text_style_pooled``).
    """

    enabled: bool = True
    text_cap: float = 0.40
    vision_cap: float = 0.80
    audio_cap: float = 0.60
    text_rate: float | None = None
    vision_rate: float | None = None
    audio_rate: float | None = None
    density_floor: float = 0.05
    allocation: str = "density"

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        for name in ("text_cap", "vision_cap", "audio_cap"):
            check_range(self, name, 0.0, MAX_RATE)
        _optional_rate(self, "text_rate", self.text_cap)
        _optional_rate(self, "vision_rate", self.vision_cap)
        _optional_rate(self, "audio_rate", self.audio_cap)
        check_range(self, "density_floor", 0.0, 1.0, lo_open=True)
        check_choice(self, "allocation", ("density", "pooled"))

    @property
    def caps(self) -> tuple[float, float, float]:
        return (self.text_cap, self.vision_cap, self.audio_cap)

    @property
    def fixed_rates(self) -> tuple[float, float, float]:
        """Fixed rates per modality, NaN where the density rule decides."""
        return tuple(
            math.nan if r is None else r
            for r in (self.text_rate, self.vision_rate, self.audio_rate)
        )  # type: ignore[return-value]


@dataclass
class ProtectConfig(ConfigBase):
    """Alignment protection (UniCache article §5.3).

    A context token is an *alignment token* when its cross-modal attention share exceeds
    ``threshold`` (see :func:`unicache_train.compress.window.window_stats`). Alignment tokens
    of a modality are compressed at ``discount`` times the modality's rate, and never evicted:
    if removed at all they are merged into a similar kept neighbour.

    Attributes:
        enabled: run this step.
        threshold: share above which a token is protected (source: 0.30).
        discount: rate multiplier for protected tokens (source: 0.5, i.e. "others 60%, they
            30%"; dense-doc preset: 0.4, stronger protection).
    """

    enabled: bool = True
    threshold: float = 0.30
    discount: float = 0.5

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_range(self, "threshold", 0.0, 1.0)
        check_range(self, "discount", 0.0, 1.0)


@dataclass
class MergeEvictConfig(ConfigBase):
    """Execution (UniCache article §6.1, §6.2): merge redundant tokens, evict low-score ones, keep
    the rest.

    Attributes:
        enabled: run this step (without it no token is removed).
        merge_threshold: redundancy above which a token is merged into its most similar kept
            neighbour (source: 0.8).
        evict_threshold: lower edge of the evict band ``(evict_threshold, merge_threshold]``
            (source: 0.5).
        merge_rescale: which importance-weighted averages of a merged entry are rescaled to
            their members' mean norm: ``"k"`` (keys only, the default), ``"kv"`` (keys and
            values, the article's §6.2) or ``"none"``. With the ``log(count)`` bias the plain
            average of V is exact for agreeing keys; rescaling V inflates the output. Chosen
            by measurement (``experiments/merge_rule/merge_rule_study.py``).
    """

    enabled: bool = True
    merge_threshold: float = 0.8
    evict_threshold: float = 0.5
    merge_rescale: str = "k"

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_range(self, "merge_threshold", 0.5, 1.0)
        check_range(self, "evict_threshold", 0.0, self.merge_threshold)
        check_choice(self, "merge_rescale", MERGE_RESCALE_RULES)


@dataclass
class QuantizeConfig(ConfigBase):
    """Symmetric per-head quantization of the segment (UniCache article §6.3, §9 pitfall 3).

    Attributes:
        enabled: run this step.
        bits: 8 (int8), 4 (int4, packed two per byte), or None / 16 (no quantization).
        granularity: ``"token_head"``: one scale per (token, head) vector of K and of V (the
            default; an outlier token cannot spoil the others), ``"head"``: one scale per
            head per sample over the segment (the source's per-head), or ``"channel"``: one
            scale per feature per head per sample over the segment (KIVI's per-channel keys; for
            caches whose features differ by orders of magnitude, e.g. an MLA latent converted by
            PCA, where one scale per vector rounds the quiet features to zero at int4), or
            ``"channel_group"``: one scale per feature per head per sample for each group of
            ``group_size`` consecutive segment entries (the last group may be shorter), so an
            outlier token (an attention sink) spoils only its own group's scales. Never a
            global scale.
        key_granularity, value_granularity: the keys' and the values' own granularity (one of
            the above), or None (the default) for ``granularity``. KIVI's split (Liu et al.,
            arXiv 2402.02750) is ``key_granularity="channel_group"``,
            ``value_granularity="token_head"``: keys have a few loud channels, values do not,
            and attention mixes values token by token (ours stays symmetric, with no zero point
            and no full-precision window of recent tokens). An MLA latent (values = the keys'
            first features, stored once) takes the keys' granularity for both of its parts.
        group_size: G, entries per group of ``"channel_group"`` (KIVI's default: 32); read
            only by that granularity. Its scales cost ``ceil(n / G) x D`` per stored head
            beside the payload's ``n x D`` values (n: valid entries).
        scale_dtype: ``"float16"`` or ``"float32"`` storage of the scales.
        windowed_layers: also quantize the cache of a sliding-window layer (its window's
            context tokens, none removed: the window already bounds how many it holds, not how
            many bytes each takes). Off by default: such a layer's cache is stored as it is
            (docs/architecture.md#sliding-window-layers).
    """

    #: The scale granularities (:data:`unicache_train.seam.QUANT_GRANULARITIES`).
    _GRANULARITIES = ("token_head", "head", "channel", "channel_group")

    enabled: bool = True
    bits: int | None = 8
    granularity: str = "token_head"
    scale_dtype: str = "float16"
    windowed_layers: bool = False
    key_granularity: str | None = None
    value_granularity: str | None = None
    group_size: int = 32

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_bool(self, "windowed_layers")
        if self.bits not in (None, 4, 8, 16) or isinstance(self.bits, bool):
            raise ConfigError(
                f"QuantizeConfig.bits={self.bits!r} is not allowed; choose one of [4, 8, 16, None]"
            )
        check_choice(self, "granularity", self._GRANULARITIES)
        for name in ("key_granularity", "value_granularity"):
            value = getattr(self, name)
            if value is not None and value not in self._GRANULARITIES:
                raise ConfigError(
                    f"QuantizeConfig.{name}={value!r} is not allowed; choose one of "
                    f"{[*self._GRANULARITIES, None]} (None: granularity's)"
                )
        check_int(self, "group_size", 1, 1 << 16)
        check_choice(self, "scale_dtype", ("float16", "float32"))

    @property
    def active(self) -> bool:
        """True when this step changes the values (bits 4 or 8)."""
        return self.enabled and self.bits in (4, 8)

    @property
    def effective_key_granularity(self) -> str:
        """The keys' granularity: ``key_granularity``, or ``granularity`` when None."""
        return self.granularity if self.key_granularity is None else self.key_granularity

    @property
    def effective_value_granularity(self) -> str:
        """The values' granularity: ``value_granularity``, or ``granularity`` when None."""
        return self.granularity if self.value_granularity is None else self.value_granularity


@dataclass
class FallbackConfig(ConfigBase):
    """Dynamic fallback (UniCache article §7.2, §9 pitfall 2), computed on the *uncompressed* input.

    ``complexity = log(max(V, 1)) + log(max(T, 1)) + lambda_align * N_align / (T + V)``, with T
    the text and V the non-text (vision + audio) context tokens of a sample and N_align its
    alignment tokens (cross-modal share above ``align_threshold``). The rate falls linearly from
    ``max_rate`` at ``complexity <= low`` to ``min_rate`` at ``complexity >= high``; it replaces
    ``UniCacheConfig.target_rate`` per sample.

    Attributes:
        enabled: run this step (off by default: then ``target_rate`` is the target).
        lambda_align: weight of the alignment share (source: 2.0).
        align_threshold: share above which a token counts in N_align.
        min_rate, max_rate: the rate interval (source: [0.40, 0.75]).
        low, high: complexity range mapped onto it (natural logs: about 8 for 256 image
            tokens + 16 text tokens, about 15 for 20k video tokens + 100 text tokens).
    """

    enabled: bool = False
    lambda_align: float = 2.0
    align_threshold: float = 0.30
    min_rate: float = 0.40
    max_rate: float = 0.75
    low: float = 8.0
    high: float = 16.0

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_range(self, "lambda_align", 0.0, 10.0)
        check_range(self, "align_threshold", 0.0, 1.0)
        check_range(self, "min_rate", 0.0, MAX_RATE)
        check_range(self, "max_rate", self.min_rate, MAX_RATE)
        check_range(self, "low", 0.0, 100.0)
        check_range(self, "high", self.low, 100.0, lo_open=True)


#: The token scorers a UniCache pipeline can rank its context tokens with (SelectionConfig.method).
SELECTION_METHODS = ("unicache", "sinks_recent", "snapkv", "retention", "attention")

#: The continuous relaxations of a learned retention policy in training (SelectionConfig).
RETENTION_RELAXATIONS = ("gumbel_sigmoid", "st_topk")


@dataclass
class SelectionConfig(ConfigBase):
    """Which scorer ranks the context tokens the merge/evict step removes
    (docs/compression_methods.md#fixed-and-learned-selections).

    The scorer replaces the importance step only; layer rates, modality budgets, alignment
    protection, merge/evict and quantization run as configured, so every selection meets the
    same budgets and is counted by the same byte accounting.

    Attributes:
        method: ``"unicache"`` (the importance score ``s``, :mod:`~unicache_train.compress.
            importance`), ``"sinks_recent"`` (attention sinks + a recent window, StreamingLLM,
            arXiv 2309.17453, :mod:`~unicache_train.compress.sinks_recent`), ``"snapkv"``
            (pooled observation-window attention, SnapKV, arXiv 2404.14469,
            :mod:`~unicache_train.compress.snapkv`) or ``"retention"`` (a learned retention
            logit per token and KV head, DMS-like, arXiv 2506.05345,
            :mod:`~unicache_train.compress.retention`).
        sinks: context tokens at the start of each sample always kept (StreamingLLM: 4).
        window: SnapKV's observation window, the last W context queries (SnapKV: 32); those
            W tokens are always kept.
        kernel: SnapKV's pooling kernel (odd; 1 = no pooling; SnapKV: 7).
        prior: the fixed scorer a retention policy starts from (its ranking at init is this
            scorer's exactly): ``"sinks_recent"`` or ``"snapkv"``.
        prior_scale: the prior's weight in the retention logit (its score spans about [0, 2]).
        relaxation: how a retention policy is trained: ``"gumbel_sigmoid"`` (every context
            token stays, weighted by a Gumbel-sigmoid gate, DMS) or ``"st_topk"`` (the hard
            selection of inference, with a straight-through gate on the kept tokens).
        temperature: the gate's temperature (smaller: closer to the hard selection).
        budget_weight: weight of the budget term ``(soft kept fraction - kept fraction of the
            byte target)^2`` added to the training objective.
        lr_scale: the policy's learning rate as a multiple of ``train.lr`` (its own AdamW
            group, no weight decay). Measured on the tiny needle study
            (experiments/retention_relaxation): at 1x (lr 1e-3) 150 steps leave the policy at
            its prior, at 30x it learns to keep the needle.
    """

    method: str = "unicache"
    sinks: int = 4
    window: int = 32
    kernel: int = 7
    prior: str = "sinks_recent"
    prior_scale: float = 4.0
    relaxation: str = "gumbel_sigmoid"
    temperature: float = 0.5
    budget_weight: float = 1.0
    lr_scale: float = 30.0

    def __post_init__(self) -> None:
        check_choice(self, "method", SELECTION_METHODS)
        check_int(self, "sinks", 0, 1024)
        check_int(self, "window", 1, 4096)
        check_int(self, "kernel", 1, 63)
        if self.kernel % 2 == 0:
            raise ConfigError(
                f"SelectionConfig.kernel={self.kernel!r} must be odd (a window centred on the "
                "token); allowed 1, 3, 5, ..., 63"
            )
        check_choice(self, "prior", ("sinks_recent", "snapkv"))
        check_range(self, "prior_scale", 0.0, 100.0, lo_open=True)
        check_choice(self, "relaxation", RETENTION_RELAXATIONS)
        check_range(self, "temperature", 0.0, 10.0, lo_open=True)
        check_range(self, "budget_weight", 0.0, 1000.0)
        check_range(self, "lr_scale", 0.0, 1000.0)


@dataclass
class UniCacheConfig(ConfigBase):
    """The whole UniCache pipeline (docs/architecture.md#unicache-pipeline). Steps run in the fixed
    order fallback -> head merge -> importance -> layer rates -> modality budgets -> protection ->
    merge/evict -> quantize.

    Attributes:
        target_rate: mean fraction of context tokens removed per layer (source: 0.6).
        rate_scale: curriculum factor in [0, 1] multiplying every token rate (and moving the
            head-merge threshold from 1, i.e. nothing merges, to its configured value).
            ``rate_scale == 0`` or ``target_rate == 0`` (fallback off) is rate 0: no head or
            token compression at all, the context K/V pass through bit-for-bit; only an active
            quantizer (bits 4/8) still applies, so rate 0 with int8 is "lossless structure,
            int8 values", not the identity.
        cache_dtype_bytes: bytes per element of the uncompressed cache ``kv_reduction`` compares
            against (2: fp16/bf16), also used for unquantized segments.
        selection: which scorer ranks the tokens merge/evict removes (:class:`SelectionConfig`;
            default ``"unicache"``: the importance step).
    """

    target_rate: float = 0.6
    rate_scale: float = 1.0
    cache_dtype_bytes: int = 2
    head_merge: HeadMergeConfig = field(default_factory=HeadMergeConfig)
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    protect: ProtectConfig = field(default_factory=ProtectConfig)
    merge_evict: MergeEvictConfig = field(default_factory=MergeEvictConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)

    def __post_init__(self) -> None:
        check_range(self, "target_rate", 0.0, MAX_RATE)
        check_range(self, "rate_scale", 0.0, 1.0)
        check_int(self, "cache_dtype_bytes", 1, 8)
        check_nested(self)
        if self.schedule.global_budget and self.selection.method not in GLOBAL_BUDGET_METHODS:
            raise ConfigError(
                "UniCacheConfig.schedule.global_budget=True needs a selection whose scores "
                f"compare across layers; selection.method={self.selection.method!r} is not one; "
                f"choose one of {list(GLOBAL_BUDGET_METHODS)}"
            )

    @property
    def is_rate_zero(self) -> bool:
        """True when no head or token compression may happen (see ``rate_scale``)."""
        return self.rate_scale == 0 or (self.target_rate == 0 and not self.fallback.enabled)


@dataclass
class XKVConfig(ConfigBase):
    """xKV cross-layer SVD compression (arXiv 2503.18893; docs/architecture.md#xkv).

    Contiguous groups of ``group_size`` layers; per group and per sample, the context keys
    (pre-RoPE by default) of the group's layers are concatenated along the feature axis and
    factorised by an fp32 SVD (values separately); rank ``r`` keeps a shared token-side factor
    ``[T, r]`` plus a small ``[r, H_kv * D]`` factor per layer. See
    :mod:`unicache_train.compress.xkv`.

    Attributes:
        group_size: layers per group (1-4; 1 is per-layer SVD). The last group is shorter when
            the depth is not a multiple.
        rank_mode: how the rank is chosen: ``"fraction"`` (``rank_fraction`` of the concatenated
            width: xKV's knob), ``"energy"`` (smallest rank keeping ``energy`` of the squared
            singular values, per sample) or ``"reduction"`` (largest rank whose stored factors,
            token-side and per-layer, take at most ``1 / reduction`` of the uncompressed 16-bit
            context cache, per sample: the knob to compare methods at equal KV bytes).
        rank_fraction: for ``"fraction"``, in (0, 1]; the source recommends 0.125-0.25 (8x-4x on
            long contexts, where the per-layer factors are negligible).
        energy: for ``"energy"``, in (0, 1].
        reduction: for ``"reduction"``, uncompressed 16-bit bytes / stored bytes in [1, 64]
            (``4.0``: 4x fewer KV bytes), counting both factors.
        min_rank: smallest rank kept (>= 1).
        refresh_every: 1: every sample of every forward gets its own SVD (xKV; always so at
            inference). k > 1, training only: the feature-side basis of each group is computed
            from the whole batch (pooled) and reused for the next k - 1 steps; each sample still
            projects its own K/V onto it (much cheaper, and a worse fit than inference's:
            +26% reconstruction error on SmolLM2 at 4x, ``experiments/xkv/xkv_factorization.py``).
        factorization: how the basis is computed (:mod:`unicache_train.compress.xkv.factor`):
            ``"gram"`` (default: eigendecomposition of the smaller Gram matrix, the SVD's basis
            to fp32 round-off at a third of its time on SmolLM2, README "xKV's
            factorisation"), ``"svd"`` (``torch.linalg.svd``, the reference) or ``"lowrank"``
            (randomized range finder of the top ``rank + 10`` directions; needs ``rank_mode``
            ``"reduction"`` or ``"fraction"``).
        keys_pre_rope: factorise keys before RoPE (xKV; RoPE is applied after reconstruction,
            at each entry's position). False factorises the rotated keys.
        gradient: ``"exact"``: the context prefill runs with gradients, so every path from the
            loss to every group member's K/V is differentiated (one more prefill forward and
            backward per step); ``"causal"``: the prefill that fits the basis runs without
            gradient and a layer's reconstruction is differentiated through its own and the
            earlier group members' K/V only (later members enter as constants); cheaper, and
            free with the KL term, whose uncompressed forward doubles as that prefill.
            Both forwards are the same numbers; only the gradient differs.
        cache_dtype_bytes: bytes per element of the stored factors and of the uncompressed
            baseline (2: fp16/bf16).
    """

    group_size: int = 2
    rank_mode: str = "fraction"
    rank_fraction: float = 0.25
    energy: float = 0.95
    reduction: float = 4.0
    min_rank: int = 1
    refresh_every: int = 1
    factorization: str = "gram"
    keys_pre_rope: bool = True
    gradient: str = "exact"
    cache_dtype_bytes: int = 2

    def __post_init__(self) -> None:
        check_int(self, "group_size", 1, 4)
        check_choice(self, "rank_mode", ("fraction", "energy", "reduction"))
        check_range(self, "rank_fraction", 0.0, 1.0, lo_open=True)
        check_range(self, "energy", 0.0, 1.0, lo_open=True)
        check_range(self, "reduction", 1.0, 64.0)
        check_int(self, "min_rank", 1, 1 << 16)
        check_int(self, "refresh_every", 1, 1 << 20)
        check_choice(self, "factorization", ("svd", "gram", "lowrank"))
        if self.factorization == "lowrank" and self.rank_mode == "energy":
            raise ConfigError(
                "XKVConfig.factorization='lowrank' is not allowed with rank_mode='energy' (the "
                "sketch sees only the top directions, not the whole spectrum); choose "
                "factorization 'gram' or 'svd', or rank_mode 'reduction' or 'fraction'"
            )
        check_bool(self, "keys_pre_rope")
        check_choice(self, "gradient", ("exact", "causal"))
        check_int(self, "cache_dtype_bytes", 1, 8)
