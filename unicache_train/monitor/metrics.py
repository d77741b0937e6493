"""Metric names shared by training, evaluation and the loggers (``group/name``).

Signal gain (see :mod:`unicache_train.monitor.gain`)::

    gain/fwd_layer_07   gain/bwd_layer_07   gain/amax_fwd   gain/amax_bwd
    mhc/composite_fwd   mhc/composite_bwd   mhc/max_log_rowsum   mhc/max_log_colsum
    mhc/sinkhorn_residual

Compression quality (fed by the compressors' per-layer stats and by evaluation)::

    compress/kv_bytes_ratio            compress/kv_bytes_ratio/layer_03
    compress/keep_ratio/<modality>     compress/keep_ratio/<modality>/layer_03
    compress/attn_kl   compress/ppl_delta   compress/recall_acc_delta
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

GAIN_FWD_LAYER = "gain/fwd_layer_{:02d}"
GAIN_BWD_LAYER = "gain/bwd_layer_{:02d}"
GAIN_AMAX_FWD = "gain/amax_fwd"
GAIN_AMAX_BWD = "gain/amax_bwd"
MHC_COMPOSITE_FWD = "mhc/composite_fwd"
MHC_COMPOSITE_BWD = "mhc/composite_bwd"
MHC_MAX_LOG_ROWSUM = "mhc/max_log_rowsum"
MHC_MAX_LOG_COLSUM = "mhc/max_log_colsum"
MHC_SINKHORN_RESIDUAL = "mhc/sinkhorn_residual"

COMPRESS_PREFIX = "compress"
COMPRESS_KV_BYTES_RATIO = "compress/kv_bytes_ratio"
COMPRESS_KEEP_RATIO = "compress/keep_ratio/{}"
COMPRESS_ATTN_KL = "compress/attn_kl"
COMPRESS_PPL_DELTA = "compress/ppl_delta"
COMPRESS_RECALL_DELTA = "compress/recall_acc_delta"

# Per-layer stats of a compressor that are worth a curve per layer; the rest are averaged only.
PER_LAYER_KEYS = ("kv_bytes_ratio", "keep_ratio")


def _scalar(value: torch.Tensor | float) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return float(value)


def compression_metrics(
    per_layer: Iterable[Mapping[str, torch.Tensor | float]],
    per_layer_keys: Iterable[str] = PER_LAYER_KEYS,
    prefix: str = COMPRESS_PREFIX,
) -> dict[str, float]:
    """Turn a compressor's per-layer stats into logger metrics.

    Args:
        per_layer: one stats dict per layer (``DecoderOutput.compression``), keys like
            ``kv_bytes_ratio``, ``keep_ratio``, ``keep_ratio/vision``.
        per_layer_keys: stats (and their ``/<modality>`` variants) also logged per layer.
        prefix: metric group.

    Returns:
        ``{prefix}/{key}`` = mean over layers, plus ``{prefix}/{key}/layer_XX`` for the
        per-layer keys. Non-finite values are kept (a NaN must show, not vanish).
    """
    sums: dict[str, list[float]] = {}
    out: dict[str, float] = {}
    keys = tuple(per_layer_keys)
    for layer, stats in enumerate(per_layer):
        for key, value in stats.items():
            v = _scalar(value)
            sums.setdefault(key, []).append(v)
            if key.split("/")[0] in keys:
                out[f"{prefix}/{key}/layer_{layer:02d}"] = v
    for key, values in sums.items():
        out[f"{prefix}/{key}"] = sum(values) / len(values)
    return out


def all_finite(metrics: Mapping[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())
