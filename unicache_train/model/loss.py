"""Next-token cross-entropy: the one definition training, validation and evaluation share.

Shape legend: B, T, V = batch, tokens, vocab.

Labels are already shifted (``labels[:, t]`` is the token after ``t``); ``IGNORE_INDEX`` marks
positions that do not count (padding, prompts). The logits are upcast to fp32 before the
softmax, whatever the model's dtype, so bf16 training and fp32 evaluation measure the same loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "masked_nll"]

IGNORE_INDEX = -100


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions.

    Args:
        logits: [B, T, V].
        labels: [B, T] next-token targets (already shifted), ``-100`` = ignore.

    Returns:
        [] (NaN when nothing is labelled; :func:`~unicache_train.inloop.
        masked_lm_loss` returns 0 instead).
    """
    return _cross_entropy(logits, labels, "mean")


def masked_nll(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and the number of targets counted (for token-weighted means).

    Args:
        logits: [B, T, V].
        labels: [B, T] (``-100`` = ignore).
        mask: [B, T] bool, extra restriction (e.g. the continuation positions).

    Returns:
        (nll_sum [], tokens [] long).
    """
    if mask is not None:
        labels = labels.masked_fill(~mask, IGNORE_INDEX)
    return _cross_entropy(logits, labels, "sum"), (labels != IGNORE_INDEX).sum()
