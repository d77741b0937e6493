"""Ranking and min-max normalization within groups (per sample and modality), vectorized.

The budget and merge/evict steps rank tokens by score within each (sample, modality) group, the
importance step normalizes its signals within each modality (UniCache article §2.3). Both run
without a loop over groups: stable sorts and scatter reductions over ``[B, T]``, with invalid
tokens in a sentinel group.

Shape legend: B, T, G = batch, tokens, groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_rank", "grouped_minmax"]

_EPS = 1e-6


def grouped_rank(
    key: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Rank of every element within its (sample, group) by ascending ``key``.

    Ties keep index order (stable sorts), so the result is deterministic. Invalid elements get
    rank ``T`` (after everything).

    Args:
        key: [B, T] float.
        group: [B, T] long in ``[0, num_groups)``.
        valid: [B, T] bool.
        num_groups: G.

    Returns:
        [B, T] long.
    """
    B, T = key.shape
    grp = torch.where(valid, group, num_groups)  # invalid -> sentinel group G
    order = torch.sort(key, dim=1, stable=True).indices  # [B, T] by key
    order = order.gather(1, torch.sort(grp.gather(1, order), dim=1, stable=True).indices)
    sizes = F.one_hot(grp, num_groups + 1).sum(1)  # [B, G + 1]
    start = torch.cumsum(sizes, 1) - sizes  # [B, G + 1] first sorted slot of each group
    slot = torch.arange(T, device=key.device).expand(B, T)
    rank_sorted = slot - start.gather(1, grp.gather(1, order))  # [B, T] rank at sorted slot
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    return torch.where(valid, rank, T)


def grouped_minmax(
    x: torch.Tensor, group: torch.Tensor, valid: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """Min-max normalize ``x`` to [0, 1] within each (sample, group); 0 for constant groups.

    Args:
        x: [B, T] float.
        group: [B, T] long.
        valid: [B, T] bool.

    Returns:
        [B, T] float, 0 where invalid.
    """
    B = x.shape[0]
    grp = torch.where(valid, group, num_groups)
    big = torch.finfo(x.dtype).max
    lo = torch.full((B, num_groups + 1), big, dtype=x.dtype, device=x.device)
    hi = torch.full((B, num_groups + 1), -big, dtype=x.dtype, device=x.device)
    lo = lo.scatter_reduce(1, grp, x, reduce="amin")
    hi = hi.scatter_reduce(1, grp, x, reduce="amax")
    lo_t, hi_t = lo.gather(1, grp), hi.gather(1, grp)
    span = hi_t - lo_t
    out = torch.where(span > _EPS, (x - lo_t) / span.clamp_min(_EPS), torch.zeros_like(x))
    return torch.where(valid, out, torch.zeros_like(x))
