"""Compressor settings at a given KV-bytes reduction, calibrated on the real cache.

Reductions are always ``uncompressed 16-bit bytes / stored bytes`` (``4.0`` = 4x fewer KV
bytes), measured from the compressor's own byte accounting on a calibration batch (packed
storage, scales and metadata included), never derived from a nominal rate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["measured_reduction", "rate_for_reduction", "text_unicache"]


def text_unicache(rate: float, pool: int = 0, bits: int | None = 8):
    """UniCache for text-only contexts at removal ``rate``: the text-style preset (no
    modality budgets, so no per-modality cap stops the rate), ``bits`` quantization, span
    pooling of the scores over ``pool`` tokens (0: none).

    Returns:
        A :class:`~unicache_train.compress.config.UniCacheConfig`.
    """
    from unicache_train.compress.config import UniCacheConfig
    from unicache_train.compress.presets import text_style_baseline

    d = text_style_baseline().to_dict()
    d["target_rate"] = float(rate)
    d["rate_scale"] = 1.0
    d["quantize"] = {**d["quantize"], "enabled": bits is not None, "bits": bits}
    d["importance"] = {**d["importance"], "pool": int(pool)}
    return UniCacheConfig.from_dict(d)


@torch.no_grad()
def measured_reduction(model, ids: torch.Tensor, split: torch.Tensor, compressor) -> float:
    """Uncompressed 16-bit bytes / stored bytes of one in-loop forward of ``compressor``.

    Args:
        ids: [B, T] calibration tokens; split: [B] context lengths.
    """
    last = torch.full((ids.shape[0], 1), ids.shape[1] - 1, dtype=torch.long, device=ids.device)
    out = model(ids, split=split, compressor=compressor, logits_at=last)  # logits unused
    kv = base = 0.0
    for st in out.compression or []:
        k, r = float(st["kv_bytes"]), float(st["kv_bytes_ratio"])
        kv += k
        base += k / r if r > 0 else 0.0
    if kv <= 0:
        raise ValueError(f"{compressor!r} reported no stored bytes")
    return base / kv


@torch.no_grad()
def rate_for_reduction(
    model,
    ids: torch.Tensor,
    split: torch.Tensor,
    build: Callable[[float], object],
    reduction: float,
    *,
    max_rate: float = 0.95,
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
    at_hi = measured_reduction(model, ids, split, build(hi))
    if at_hi < reduction:
        return hi, at_hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        got = measured_reduction(model, ids, split, build(mid))
        if got < reduction:
            lo = mid
        else:
            hi, at_hi = mid, got
    return round(hi, 4), at_hi
