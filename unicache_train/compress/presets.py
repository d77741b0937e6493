"""Scenario presets (UniCache article §8.1, §8.2) and the text-style baseline.

Each function returns a fresh, validated :class:`UniCacheConfig`; overrides are keyword
arguments of the function or plain attribute edits afterwards.

* :func:`default` (§8.1): head threshold 0.88, layers 0.75 / 0.60 / 0.45, weights
  0.4/0.3/0.2/0.1, density budgets with caps, discount 0.5, int8. One measured departure from
  the source: a merged entry's key is rescaled to its members' mean norm but its value stays
  the average (``merge_evict.merge_rescale = "k"``; the source's K-and-V rescale is ``"kv"``),
  see ``experiments/merge_rule/merge_rule_study.py``. Every preset below inherits it.
* :func:`long_video` (§8.2): vision at 0.78 (0.75-0.8) and text kept at 0.25 (at the reference
  target, following the layer curve), and the same patch in adjacent frames counts as a
  neighbour (``frame_stride = patches_per_frame``), so redundant patches merge across frames.
* :func:`dense_doc_qa` (§8.2): text at 0.175 (0.15-0.2), vision 0.7, stronger alignment
  protection (discount 0.4).
* :func:`realtime` (§8.2): head merging favoured (threshold 0.85), every token rate 5 points
  lower (target 0.55, fallback interval [0.35, 0.70]).
* :func:`text_style_baseline`: what a text KV method does to a multimodal cache (the comparison
  point of the evaluation): attention normalized over all tokens, one uniform rate for every
  modality, no alignment protection. Everything else as the default.
* :func:`text_style_pooled`: the same, but with one pooled budget instead of a uniform rate: all
  context tokens compete in one ranking of the (globally normalized) scores, as a text method's
  global top-k does, so a modality's share of the removal is decided by its scores.
* :func:`sinks_recent`, :func:`snapkv`, :func:`retention`: the fixed selections StreamingLLM
  (attention sinks + a recent window, arXiv 2309.17453) and SnapKV (pooled observation-window
  attention, arXiv 2404.14469), and the learned retention policy (DMS-like, arXiv 2506.05345),
  as the methods run them: one uniform rate for every layer and modality, pure eviction (no
  merging, no head merging), no alignment protection; int8 storage like every preset (override
  ``quantize.bits``). docs/compression_methods.md.
"""

from __future__ import annotations

from collections.abc import Callable

from unicache_train.compress.config import UniCacheConfig

__all__ = [
    "default",
    "long_video",
    "dense_doc_qa",
    "realtime",
    "text_style_baseline",
    "text_style_pooled",
    "sinks_recent",
    "snapkv",
    "retention",
    "PRESETS",
    "preset",
]


def default() -> UniCacheConfig:
    """The source's default configuration (§8.1)."""
    return UniCacheConfig()


def long_video(patches_per_frame: int = 0, vision_rate: float = 0.78) -> UniCacheConfig:
    """Long video: hard visual compression, adjacent-frame patch merging.

    Args:
        patches_per_frame: visual tokens per frame (0: no cross-frame neighbours).
        vision_rate: visual rate at the reference target (source: 0.75-0.8).
    """
    cfg = UniCacheConfig()
    cfg.budget.vision_rate = vision_rate
    cfg.budget.text_rate = 0.25
    cfg.importance.frame_stride = patches_per_frame
    return _revalidate(cfg)


def dense_doc_qa(text_rate: float = 0.175) -> UniCacheConfig:
    """Dense document QA: gentle text compression, stronger alignment protection."""
    cfg = UniCacheConfig()
    cfg.budget.text_rate = text_rate
    cfg.budget.vision_rate = 0.70
    cfg.protect.discount = 0.4
    return _revalidate(cfg)


def realtime() -> UniCacheConfig:
    """Realtime dialogue: more head merging, token rates 5 points lower."""
    cfg = UniCacheConfig()
    cfg.head_merge.threshold = 0.85
    cfg.target_rate = 0.55
    cfg.fallback.min_rate, cfg.fallback.max_rate = 0.35, 0.70
    return _revalidate(cfg)


def text_style_baseline() -> UniCacheConfig:
    """Global normalization, uniform budgets, no protection (the comparison baseline)."""
    cfg = UniCacheConfig()
    cfg.importance.normalize = "global"
    cfg.budget.enabled = False
    cfg.protect.enabled = False
    return _revalidate(cfg)


def text_style_pooled() -> UniCacheConfig:
    """Global normalization, one pooled budget (global top-k), no protection."""
    cfg = UniCacheConfig()
    cfg.importance.normalize = "global"
    cfg.budget.allocation = "pooled"
    cfg.protect.enabled = False
    return _revalidate(cfg)


def _selection(method: str) -> UniCacheConfig:
    """Only ``method``'s ranking decides: uniform rates, pure eviction, no protection."""
    cfg = UniCacheConfig()
    cfg.selection.method = method
    cfg.head_merge.enabled = False
    cfg.schedule.enabled = False
    cfg.budget.enabled = False
    cfg.protect.enabled = False
    # Thresholds at 1: no token is redundant enough to merge or to enter the evict band, so
    # the scorer's ranking alone orders the removal.
    cfg.merge_evict.merge_threshold = 1.0
    cfg.merge_evict.evict_threshold = 1.0
    return _revalidate(cfg)


def sinks_recent() -> UniCacheConfig:
    """StreamingLLM: attention sinks + a recent window (arXiv 2309.17453)."""
    return _selection("sinks_recent")


def snapkv() -> UniCacheConfig:
    """SnapKV: pooled observation-window attention (arXiv 2404.14469)."""
    return _selection("snapkv")


def retention() -> UniCacheConfig:
    """A learned retention policy starting from sinks + recent (DMS-like, arXiv 2506.05345)."""
    return _selection("retention")


def attention() -> UniCacheConfig:
    """The learned attention-regression scorer (KVzap / Locret style,
    :mod:`unicache_train.compress.attention_scorer`): sinks and a recent window kept, the rest
    ranked by the predicted attention."""
    return _selection("attention")


def _revalidate(cfg: UniCacheConfig) -> UniCacheConfig:
    # Attribute edits bypass __post_init__: rebuild so a preset can never carry a bad value.
    return UniCacheConfig.from_dict(cfg.to_dict())


PRESETS: dict[str, Callable[[], UniCacheConfig]] = {
    "default": default,
    "long_video": long_video,
    "dense_doc_qa": dense_doc_qa,
    "realtime": realtime,
    "text_style_baseline": text_style_baseline,
    "text_style_pooled": text_style_pooled,
    "sinks_recent": sinks_recent,
    "snapkv": snapkv,
    "retention": retention,
    "attention": attention,
}


def preset(name: str) -> UniCacheConfig:
    """A preset by name (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise KeyError(f"unknown UniCache preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
