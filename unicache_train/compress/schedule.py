"""Per-layer compression rates on a smooth cosine curve (UniCache article §4.3, §9 pitfall 4).

Shallow layers hold low-level, redundant features and are compressed hard; deep layers hold
semantics and cross-modal fusion and are compressed gently. The source's thirds (0.75 / 0.60 /
0.45) as hard steps cause representation jumps at the boundaries, and linear interpolation is
not smooth enough for shallow models, so the curve is a half cosine::

    curve(l) = deep + (shallow - deep) * (1 + cos(pi * x_l)) / 2,  x_l = l / (L - 1)

(x = 0.5 for a single layer). It passes shallow at layer 0, the mean at the middle and deep at
the last layer; consecutive layers differ by at most ``(shallow - deep) * pi / (2 (L - 1))``
(the curve's max slope). Its mean over layers is exactly ``(shallow + deep) / 2`` (the cosine
terms cancel in pairs), so scaling by ``target / mean`` gives a schedule whose mean over layers
is the target: the defaults at target 0.6 are exactly 0.75 -> 0.60 -> 0.45. Rates are clipped
to ``[0, MAX_RATE]`` (only reached for targets above ~0.76).

With ``global_budget`` the rates come from elsewhere: one ranking over every layer's context
tokens (:mod:`~unicache_train.compress.global_budget`) leaves each layer a rate, handed to this
step in the layer's :attr:`~unicache_train.seam.CompressionInput.fit` as :class:`LayerRates`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import MAX_RATE, ScheduleConfig
from unicache_train.compress.state import CompressionState

__all__ = ["LayerSchedule", "LayerRates", "cosine_curve", "layer_rate"]


@dataclass
class LayerRates:
    """Each layer's rate per sample, decided over all layers at once (``global_budget``).

    Attributes:
        rates: layer -> [B] float32, the fraction of that layer's context tokens to remove.
    """

    rates: dict[int, torch.Tensor]


def cosine_curve(num_layers: int, shallow: float, deep: float) -> list[float]:
    """The unscaled curve for layers ``0..num_layers-1``."""
    out = []
    for l in range(num_layers):
        x = l / (num_layers - 1) if num_layers > 1 else 0.5
        out.append(deep + (shallow - deep) * 0.5 * (1.0 + math.cos(math.pi * x)))
    return out


def layer_rate(
    layer_idx: int,
    num_layers: int,
    target: torch.Tensor | float,
    shallow: float = 0.75,
    deep: float = 0.45,
) -> torch.Tensor:
    """Rate of one layer, scaled so that the mean over layers equals ``target``.

    Args:
        layer_idx, num_layers: position in the decoder.
        target: [B] per-sample targets (or a float).
        shallow, deep: curve end points (their mean is the reference the curve is scaled by).

    Returns:
        [B] (or scalar) rates in ``[0, MAX_RATE]``.
    """
    curve = cosine_curve(num_layers, shallow, deep)[layer_idx]
    factor = curve / (0.5 * (shallow + deep))
    return torch.as_tensor(target, dtype=torch.float32).mul(factor).clamp(0.0, MAX_RATE)


@dataclass
class LayerSchedule(ScheduleConfig):
    """Pipeline step: ``state.layer_rate`` from the per-sample target (uniform when disabled)."""

    stage: ClassVar[int] = 3

    def __call__(self, state: CompressionState) -> CompressionState:
        if self.global_budget:
            fit = state.inp.fit
            if not isinstance(fit, LayerRates):
                raise ValueError(
                    "schedule.global_budget=True needs every layer's context before any layer "
                    f"is compressed, but layer {state.inp.layer_idx} came without the rates of "
                    "a recording pass (CompressionInput.fit is "
                    f"{type(fit).__name__}); pass the compressor to Decoder.forward, "
                    "prefill_compressed, run_long_context or CompressedCache, which record first"
                )
            state.layer_rate = fit.rates[state.inp.layer_idx].to(state.target.device).float()
        elif self.enabled:
            state.layer_rate = layer_rate(
                state.inp.layer_idx,
                state.inp.num_layers,
                state.target,
                self.shallow_rate,
                self.deep_rate,
            )
        else:
            state.layer_rate = state.target.float().clamp(0.0, MAX_RATE)
        return state
