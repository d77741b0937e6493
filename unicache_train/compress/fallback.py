"""Dynamic fallback: the target rate follows the input's complexity (UniCache article §7.2).

``complexity = log(max(V, 1)) + log(max(T, 1)) + lambda * N_align / (T + V)`` per sample, with
T the text context tokens, V the non-text (vision + audio) context tokens and N_align the
alignment tokens (cross-modal attention share above ``align_threshold``, on this layer's
*uncompressed* K/V). ``max(., 1)`` keeps single-modality inputs finite (log 1 = 0).

Mapping (linear, clipped): ``rate = max_rate - (max_rate - min_rate) * clip((complexity - low) /
(high - low), 0, 1)``: simple inputs (a short image + prompt) get up to 0.75, complex ones
(long video, dense references) down to 0.40. It replaces ``target_rate`` per sample, so every
sample of a batch gets its own rate (article §8.3: batch members must not drag each other).

NOTE: this step runs FIRST, on the untouched input (article §9 pitfall 2: estimating it after
compression made the fallback contradict itself); the composer enforces the order.

Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import FallbackConfig
from unicache_train.compress.state import CompressionState
from unicache_train.compress.window import window_stats
from unicache_train.seam import CompressionInput

__all__ = ["DynamicFallback", "complexity", "fallback_rate"]


@torch.no_grad()
def complexity(
    inp: CompressionInput, window: int, lambda_align: float = 2.0, align_threshold: float = 0.30
) -> torch.Tensor:
    """Complexity of each sample's uncompressed context.

    Args:
        inp: the compressor's input (never a compressed view).
        window: observation window for the alignment statistics.

    Returns:
        [B] float32.
    """
    mask = inp.context_mask
    text = (mask & (inp.modality_ids == 0)).sum(1).float()
    other = (mask & (inp.modality_ids != 0)).sum(1).float()
    ws = window_stats(inp.queries, inp.keys, inp.modality_ids, mask, window)
    n_align = (mask & (ws.cross > align_threshold)).sum(1).float()
    share = n_align / (text + other).clamp_min(1.0)
    return other.clamp_min(1.0).log() + text.clamp_min(1.0).log() + lambda_align * share


def fallback_rate(
    c: torch.Tensor,
    min_rate: float = 0.40,
    max_rate: float = 0.75,
    low: float = 8.0,
    high: float = 16.0,
) -> torch.Tensor:
    """Complexity [B] -> rate [B] in ``[min_rate, max_rate]``, decreasing in complexity."""
    x = ((c - low) / (high - low)).clamp(0.0, 1.0)
    return max_rate - (max_rate - min_rate) * x


@dataclass
class DynamicFallback(FallbackConfig):
    """Pipeline step: replace ``state.target`` by the complexity-derived rate (times the
    curriculum ``rate_scale``). Must run before any structural step."""

    stage: ClassVar[int] = 0

    def __call__(self, state: CompressionState) -> CompressionState:
        if not self.enabled:
            return state
        if state.keys is not state.inp.keys or state.segment is not None:
            raise RuntimeError(
                "DynamicFallback must run on the uncompressed input, before head merging or "
                "token compression: its complexity is measured on the untouched input "
                "(docs/architecture.md#unicache-pipeline)"
            )
        c = complexity(state.inp, state.window, self.lambda_align, self.align_threshold)
        state.complexity = c
        rate = fallback_rate(c, self.min_rate, self.max_rate, self.low, self.high)
        state.target = rate * state.rate_scale
        return state
