"""Per-sample counts over the context: context lengths, tokens per modality, the modality-id check.

Every UniCache step works with per-sample context lengths: a token takes part only where
``context_mask`` is True. Shape legend: B, T = batch, tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unicache_train.seam import NUM_MODALITIES

__all__ = ["check_modalities", "context_lengths", "modality_counts"]


def check_modalities(modality_ids: torch.Tensor, context_mask: torch.Tensor) -> None:
    """Raise if a context token has a modality id outside ``[0, NUM_MODALITIES)``."""
    bad = context_mask & ((modality_ids < 0) | (modality_ids >= NUM_MODALITIES))
    if bool(bad.any()):
        found = sorted(set(modality_ids[bad].tolist()))
        raise ValueError(
            f"modality_ids {found} are not supported; expected 0 text, 1 vision, 2 audio"
        )


def context_lengths(context_mask: torch.Tensor) -> torch.Tensor:
    """context_mask: [B, T] bool -> [B] long, context tokens per sample."""
    return context_mask.sum(1)


def modality_counts(modality_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Tokens per modality where ``mask`` holds.

    Args:
        modality_ids: [B, T] long.
        mask: [B, T] bool.

    Returns:
        [B, NUM_MODALITIES] long.
    """
    onehot = F.one_hot(modality_ids.clamp(0, NUM_MODALITIES - 1), NUM_MODALITIES)  # [B, T, 3]
    return (onehot * mask[..., None]).sum(1)
