"""Pooled observation-window attention (SnapKV, Li et al., arXiv 2404.14469).

SnapKV observes that the attention the last few prompt tokens (the *observation window*) pay to
the earlier tokens predicts which of them generation will need. It scores every prefix token by
the attention it receives from the window's queries, smooths the scores with a 1-D pooling
(so a selected token brings its neighbours, and multi-token spans survive whole), keeps the top
scores plus the window itself, and evicts the rest. As a scorer of the UniCache pipeline:

    score = 2                                   for the last ``window`` context tokens,
    score = avgpool_kernel(attn / W)            otherwise,

with ``attn`` the attention each context token receives from the last ``W`` context queries
(causal, softmax per query, averaged over query heads:
:func:`~unicache_train.compress.window.window_stats`, the statistics the importance step shares),
and the average pooling taken over context tokens of the same modality only. Divided by ``W``
the pooled mass lies in [0, 1], below the window's 2.

One departure from SnapKV, forced by the seam: SnapKV selects per KV head, while a
:class:`~unicache_train.seam.KVSegment` keeps one token set for all heads of a layer, so the
heads' attention is averaged before the ranking (kvpress's SnapKVPress averages the query heads
of a group the same way, then ranks per KV head).

With pure eviction (:func:`unicache_train.compress.presets.snapkv`) this is SnapKV at the
budget's kept fraction; with budgets, protection or merging the same ranking runs inside them.

Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from unicache_train.compress.config import SelectionConfig
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES

__all__ = ["SnapKV", "snapkv_scores", "avg_pool_within", "WINDOW_SCORE"]

#: Score of an observation-window token: above every pooled attention score (in [0, 1]).
WINDOW_SCORE = 2.0


def avg_pool_within(
    scores: torch.Tensor, modality_ids: torch.Tensor, context_mask: torch.Tensor, kernel: int
) -> torch.Tensor:
    """Mean of ``scores`` over the ``kernel`` tokens centred on each context token, counting only
    context tokens of the token's own modality (a text span is never lifted by an image patch).

    Args:
        scores: [B, T]; modality_ids: [B, T]; context_mask: [B, T] bool.
        kernel: odd window length (1: the scores unchanged).

    Returns:
        [B, T], 0 outside the context.
    """
    if kernel <= 1:
        return torch.where(context_mask, scores, torch.zeros_like(scores))
    out = torch.zeros_like(scores)
    for m in range(NUM_MODALITIES):  # every id: finding the present ones would sync the device
        keep = (context_mask & (modality_ids == m)).float()  # [B, T]
        both = torch.stack([scores.float() * keep, keep], 1)  # [B, 2, T]
        pooled = F.avg_pool1d(both, kernel_size=kernel, stride=1, padding=kernel // 2)
        mean = pooled[:, 0] / pooled[:, 1].clamp_min(1e-12)  # [B, T]
        out = torch.where(keep.bool(), mean.to(scores.dtype), out)
    return out


@torch.no_grad()
def snapkv_scores(state: CompressionState, window: int, kernel: int) -> torch.Tensor:
    """SnapKV's ranking of the context of ``state`` as scores (see module docstring).

    Args:
        state: the pipeline state (its observation-window statistics are shared and cached).
        window: W, the last context queries observed (and kept).
        kernel: odd pooling kernel.

    Returns:
        [B, T] float32 in [0, 2], 0 outside the context.
    """
    pooled, in_window = _pooled(state, window, kernel)
    mask = state.context_mask
    s = torch.where(in_window, torch.full_like(pooled, WINDOW_SCORE), pooled.clamp(0.0, 1.0))
    return torch.where(mask, s, torch.zeros_like(s))


def _pooled(state: CompressionState, window: int, kernel: int):
    """(pooled window attention / W [B, T], observation-window tokens [B, T] bool)."""
    state.configure(window, state.neighbours, state.frame_stride, state.similarity)
    mask = state.context_mask
    ws = state.window_stats()  # attn [B, T]: summed over the window's rows
    W = float(min(window, mask.shape[1]))
    pooled = avg_pool_within(ws.attn.float() / W, state.modality_ids, mask, kernel)
    rank = torch.cumsum(mask.long(), 1) - 1  # [B, T] context rank
    n = mask.sum(1, keepdim=True)  # [B, 1]
    return pooled, mask & (rank >= n - window)


@dataclass
class SnapKV(SelectionConfig):
    """Pipeline step (the scorer): ``state.scores`` = window first, then pooled attention."""

    stage: ClassVar[int] = 2

    def __call__(self, state: CompressionState) -> CompressionState:
        state.scores = snapkv_scores(state, self.window, self.kernel)
        return state

    @torch.no_grad()
    def global_scores(self, state: CompressionState) -> torch.Tensor:
        """[B, T] the pooled attention mass (in [0, 1] on every layer), ``+inf`` for the
        observation window (``ScheduleConfig.global_budget``)."""
        pooled, in_window = _pooled(state, self.window, self.kernel)
        return torch.where(in_window, torch.full_like(pooled, float("inf")), pooled.float())
