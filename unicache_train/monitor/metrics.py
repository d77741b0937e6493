"""Metric names shared by training, evaluation and the loggers (``group/name``).

Signal gain (see :mod:`unicache_train.monitor.gain`)::

    gain/fwd_layer_07   gain/bwd_layer_07   gain/amax_fwd   gain/amax_bwd
    mhc/composite_fwd   mhc/composite_bwd   mhc/max_log_rowsum   mhc/max_log_colsum
    mhc/sinkhorn_residual

Compression quality (fed by the compressors' per-layer stats and by evaluation; the words are
docs/architecture.md#words: a rate is a fraction of context tokens removed, a reduction is
uncompressed 16-bit bytes / stored bytes)::

    compress/kv_reduction                 compress/kv_reduction/layer_03
    compress/rate_realized                compress/rate_realized/layer_03
    compress/rate_realized/<modality>     compress/rate_realized/<modality>/layer_03
    compress/attn_kl   compress/ppl_delta   compress/recall_acc_delta
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from unicache_train.seam import pooled_kv_bytes

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
COMPRESS_KV_REDUCTION = "compress/kv_reduction"
COMPRESS_RATE_REALIZED = "compress/rate_realized"
COMPRESS_ATTN_KL = "compress/attn_kl"
COMPRESS_PPL_DELTA = "compress/ppl_delta"
COMPRESS_RECALL_DELTA = "compress/recall_acc_delta"

# Per-layer stats of a compressor that are worth a curve per layer; the rest are averaged only.
PER_LAYER_KEYS = ("kv_reduction", "rate_realized")


def _tensor(value: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(value).detach().float()


def layer_mean_stats(
    per_layer: Iterable[Mapping[str, torch.Tensor | float]], prefix: str = COMPRESS_PREFIX
) -> dict[str, torch.Tensor]:
    """Per-layer compressor stats -> ``{prefix}/{key}`` over the layers that report it, as
    tensors on the stats' device (no device sync: the training step logs these every step).

    The mean over layers, except ``kv_bytes`` (summed: the bytes of the whole cache of the
    batch) and ``kv_reduction`` (the whole cache's, uncompressed / stored summed over layers,
    :func:`unicache_train.seam.pooled_kv_bytes`; not a mean of ratios).
    """
    per_layer = [{k: _tensor(v) for k, v in st.items()} for st in per_layer]
    values: dict[str, list[torch.Tensor]] = {}
    for stats in per_layer:
        for key, value in stats.items():
            values.setdefault(key, []).append(value.mean())
    out = {}
    for key, vs in values.items():
        stacked = torch.stack(vs)
        out[f"{prefix}/{key}"] = stacked.sum() if key == "kv_bytes" else stacked.mean()
    if "kv_reduction" in values and "kv_bytes" in values:
        stored, uncompressed = pooled_kv_bytes(per_layer)
        out[f"{prefix}/kv_reduction"] = (uncompressed / stored.clamp_min(1.0)).float()
    return out


def compression_metrics(
    per_layer: Iterable[Mapping[str, torch.Tensor | float]],
    per_layer_keys: Iterable[str] = PER_LAYER_KEYS,
    prefix: str = COMPRESS_PREFIX,
) -> dict[str, float]:
    """Turn a compressor's per-layer stats into logger metrics (floats: syncs the device).

    Args:
        per_layer: one stats dict per layer (``DecoderOutput.compression_stats``), keys like
            ``kv_bytes``, ``kv_reduction``, ``rate_realized``, ``rate_realized/vision``.
        per_layer_keys: stats (and their ``/<modality>`` variants) also logged per layer.
        prefix: metric group.

    Returns:
        :func:`layer_mean_stats`, plus ``{prefix}/{key}/layer_XX`` for the per-layer keys.
        Non-finite values are kept (a NaN must show, not vanish).
    """
    per_layer = list(per_layer)
    keys = tuple(per_layer_keys)
    out: dict[str, float] = {}
    for layer, stats in enumerate(per_layer):
        for key, value in stats.items():
            if key.split("/")[0] in keys:
                out[f"{prefix}/{key}/layer_{layer:02d}"] = float(_tensor(value).mean())
    out.update({k: float(v) for k, v in layer_mean_stats(per_layer, prefix).items()})
    return out


def all_finite(metrics: Mapping[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())
