"""Alignment protection (UniCache article §5.3).

Alignment tokens are the text tokens that point at an image region and the patches that text
tokens look at. They are found from cross-modal attention: a context token is protected when
its cross-modal attention share (see :class:`~unicache_train.compress.window.WindowStats`:
the larger of the share of its own attention that goes to other modalities and the mean
attention it receives from each other-modality query of the observation window) *exceeds*
``threshold`` (0.30).

Protected tokens get the discounted rate ``discount * R_m`` (0.5: "others lose 60%, they lose
30%") inside their modality's budget, and they are **never evicted**: the merge/evict step
removes a protected token only by merging it into a similar kept neighbour, so its content
survives in a merged entry; when no such neighbour exists the token stays and an unprotected
token of the same modality is removed instead (:mod:`~unicache_train.compress.merge_evict`).

Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unicache_train.compress.config import ProtectConfig
from unicache_train.compress.state import CompressionState

__all__ = ["AlignmentProtect", "alignment_tokens"]


def alignment_tokens(
    cross_share: torch.Tensor, context_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Protected tokens.

    Args:
        cross_share: [B, T] cross-modal attention share in [0, 1].
        context_mask: [B, T] bool.
        threshold: share a token must exceed.

    Returns:
        [B, T] bool.
    """
    return context_mask & (cross_share > threshold)


@dataclass
class AlignmentProtect(ProtectConfig):
    """Pipeline step: ``state.protected`` and ``state.discount``."""

    stage: ClassVar[int] = 5

    def __call__(self, state: CompressionState) -> CompressionState:
        if self.enabled:
            state.protected = alignment_tokens(
                state.window_stats().cross, state.context_mask, self.threshold
            )
            state.discount = self.discount
        return state
