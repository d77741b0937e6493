"""Compressor settings at a given KV-bytes reduction, calibrated on the real cache.

A reduction is always ``uncompressed 16-bit bytes / stored bytes`` (``4.0`` = 4x fewer KV
bytes; docs/architecture.md#words), summed from the compressor's per-layer stats on a
calibration batch (packed payload and quantization scales,
:func:`unicache_train.seam.pooled_kv_bytes`;
:meth:`~unicache_train.model.compressed_cache.CompressedKVCache.kv_bytes`, which the recall task
reports, also counts the merge counts and head maps a decoding cache keeps), never derived from
a nominal rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unicache_train.compress.config import MAX_RATE
from unicache_train.seam import pooled_kv_bytes

__all__ = [
    "measured_reduction",
    "rate_for_reduction",
    "unicache_at_rate",
    "text_unicache",
    "selection_unicache",
    "unicache_compressor",
]

_BITS = {"none": None, "int8": 8, "int4": 4}


def unicache_at_rate(base: Any, rate: float, quantize: str = "config") -> Any:
    """A copy of UniCache config ``base`` at target ``rate`` (full ``rate_scale``), with the
    quantizer overridden unless ``quantize == "config"`` (``"none"``, ``"int8"``, ``"int4"``)."""
    from unicache_train.compress.config import UniCacheConfig

    d = base.to_dict()
    d["target_rate"] = float(rate)
    d["rate_scale"] = 1.0
    if quantize != "config":
        if quantize not in _BITS:
            raise ValueError(
                f"quantize={quantize!r} is not allowed; choose one of {['config', *_BITS]}"
            )
        bits = _BITS[quantize]
        d["quantize"] = {**d["quantize"], "bits": bits, "enabled": bits is not None}
    return UniCacheConfig.from_dict(d)


def text_unicache(
    rate: float, pool: int = 0, quantize: str = "int8", granularity: str = "token_head"
) -> Any:
    """UniCache for text-only contexts at removal ``rate``: the text-style preset (no
    modality budgets, so no per-modality cap stops the rate), ``quantize`` with its scales at
    ``granularity`` (:class:`~unicache_train.compress.config.QuantizeConfig`), span pooling of
    the scores over ``pool`` tokens (0: none).

    Returns:
        A :class:`~unicache_train.compress.config.UniCacheConfig`.
    """
    from unicache_train.compress.config import UniCacheConfig
    from unicache_train.compress.presets import text_style_baseline

    d = unicache_at_rate(text_style_baseline(), rate, quantize).to_dict()
    d["importance"] = {**d["importance"], "pool": int(pool)}
    d["quantize"] = {**d["quantize"], "granularity": granularity}  # validated by from_dict
    return UniCacheConfig.from_dict(d)


@torch.no_grad()
def measured_reduction(
    model,
    ids: torch.Tensor,
    split: torch.Tensor,
    compressor,
    modality_ids: torch.Tensor | None = None,
) -> float:
    """Uncompressed 16-bit bytes / stored bytes of one in-loop forward of ``compressor``.

    Args:
        ids: [B, T] calibration tokens; split: [B] context lengths; modality_ids: [B, T].
    """
    last = torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
    out = model(  # logits unused: only the compressor's byte stats are read
        ids, modality_ids=modality_ids, split=split, compressor=compressor, logits_at=last
    )
    kv, base = pooled_kv_bytes(out.compression_stats)
    if kv <= 0:
        raise ValueError(f"{compressor!r} reported no stored bytes")
    return float(base / kv)


@torch.no_grad()
def rate_for_reduction(
    model,
    ids: torch.Tensor,
    split: torch.Tensor,
    build: Callable[[float], object],
    reduction: float,
    *,
    modality_ids: torch.Tensor | None = None,
    max_rate: float = MAX_RATE,
    iters: int = 7,
) -> tuple[float, float]:
    """The smallest removal rate whose measured reduction reaches ``reduction`` (bisection).

    Args:
        build: rate -> compressor.
        reduction: target ``uncompressed / stored`` (> 1).
        max_rate: the largest rate tried.

    Returns:
        (rate, measured reduction at that rate); at ``max_rate`` when it cannot reach the
        target (the caller reports the shortfall: the measured reduction is then smaller).
    """
    if reduction <= 1.0:
        raise ValueError(f"reduction={reduction!r} is out of range; allowed (1, inf)")
    lo, hi = 0.0, max_rate
    at_hi = measured_reduction(model, ids, split, build(hi), modality_ids)
    if at_hi < reduction:
        return hi, at_hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        got = measured_reduction(model, ids, split, build(mid), modality_ids)
        if got < reduction:
            lo = mid
        else:
            hi, at_hi = mid, got
    return round(hi, 4), at_hi


def selection_unicache(method: str, rate: float, quantize: str = "int4") -> Any:
    """A fixed or learned selection's preset (``"sinks_recent"``, ``"snapkv"``,
    ``"retention"``: :mod:`unicache_train.compress.presets`) at removal ``rate`` with
    ``quantize`` storage: only the selection's ranking decides which tokens go."""
    from unicache_train.compress.presets import PRESETS

    if method not in ("sinks_recent", "snapkv", "retention"):
        raise ValueError(
            f"selection method={method!r} is not allowed; choose one of "
            "['sinks_recent', 'snapkv', 'retention']"
        )
    return unicache_at_rate(PRESETS[method](), rate, quantize)


def unicache_compressor(cfg: Any, model: Any = None) -> Any:
    """``UniCacheCompressor(cfg)``; a learned retention selection uses ``model``'s policy
    (``model.kv_retention``, in eval mode) or, for a model trained without one, a zero policy:
    its prior's ranking (the training-free starting point)."""
    from unicache_train.compress import UniCacheCompressor
    from unicache_train.compress.retention import RETENTION_ATTR, RetentionPolicy

    if cfg.selection.method != "retention":
        return UniCacheCompressor(cfg)
    policy = getattr(model, RETENTION_ATTR, None) if model is not None else None
    if policy is None:
        if model is None:
            raise ValueError("a retention selection needs the model (its policy or its shape)")
        ref = next(model.parameters())
        policy = RetentionPolicy.for_model(model).to(ref.device)  # the keys' device
    return UniCacheCompressor(cfg, retention=policy.eval())
