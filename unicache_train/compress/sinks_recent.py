"""Attention sinks + a recent window (StreamingLLM, Xiao et al., arXiv 2309.17453).

StreamingLLM keeps the first few tokens of the sequence (the *attention sinks*: softmax parks
surplus attention there, and evicting them breaks the model) and a window of the most recent
tokens, and evicts the middle. As a scorer of the UniCache pipeline it ranks, per sample and
context token,

    score = 2                      for the first ``sinks`` context tokens (rank < sinks),
    score = i / (L - 1)            for the i-th of L context tokens otherwise (recency),

so the merge/evict step, which removes the lowest scores first until the layer's budget is met,
keeps the sinks and then the most recent tokens. With pure eviction (``merge_threshold =
evict_threshold = 1``, :func:`unicache_train.compress.presets.sinks_recent`) and no modality
budgets this is StreamingLLM at the budget's kept fraction: the recent window is whatever the
byte target leaves after the sinks. With budgets, protection or merging enabled, the same
ranking runs inside them (per modality, protected tokens only merged), like every other scorer.

No gradient (the selection is discrete); the kept K/V carry theirs.

Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import SelectionConfig
from unicache_train.compress.importance import recency
from unicache_train.compress.state import CompressionState

__all__ = ["SinksRecent", "sinks_recent_scores", "SINK_SCORE"]

#: Score of a sink token: above every recency score (which lie in [0, 1]).
SINK_SCORE = 2.0


@torch.no_grad()
def sinks_recent_scores(context_mask: torch.Tensor, sinks: int) -> torch.Tensor:
    """StreamingLLM's ranking as scores (see module docstring).

    Args:
        context_mask: [B, T] bool.
        sinks: context tokens kept first in every sample.

    Returns:
        [B, T] float32 in [0, 2], 0 outside the context.
    """
    rank = torch.cumsum(context_mask.long(), 1) - 1  # [B, T] context rank
    r = recency(context_mask)
    s = torch.where(rank < sinks, torch.full_like(r, SINK_SCORE), r)
    return torch.where(context_mask, s, torch.zeros_like(s))


@dataclass
class SinksRecent(SelectionConfig):
    """Pipeline step (the scorer): ``state.scores`` = sinks first, then recency."""

    stage: ClassVar[int] = 2

    def __call__(self, state: CompressionState) -> CompressionState:
        state.scores = sinks_recent_scores(state.context_mask, self.sinks)
        return state
