"""Modality budgets from information density (UniCache article §5.1, §5.2).

1. Density per modality and sample: ``rho_m = 1 - mean pairwise cosine`` of the modality's
   context K/V (per KV head, keys and values averaged, then over heads; clamped to
   ``[density_floor, 2]``). More similar tokens = more redundancy = less dense. The mean over
   pairs uses ``|sum_i u_i|^2 = n + sum_{i != j} <u_i, u_j>`` with unit vectors, so it costs
   O(T D), not O(T^2).
2. Rates inversely proportional to density, ``R_m = k / rho_m``, with k chosen so that the
   token-weighted mean over modalities equals the layer rate: ``sum_m n_m R_m = R * N``.
3. Caps (text 0.40, vision 0.80, audio 0.60): a modality over its cap is clipped to it and the
   excess removal moves to the uncapped modalities (water-filling, at most one round per
   modality). If every modality is capped the budget falls short of the target (caps win).

Fixed per-modality rates (presets) replace step 2 for that modality and follow the layer
curve (``fixed * R / target_rate``); the density rule shares the rest among the others.

``allocation="pooled"`` replaces all of this by one global competition (the text-style baseline
``presets.text_style_pooled``): the ``round(R * N)`` context tokens of a sample with the lowest
importance scores are what a text KV method's top-k would drop, and each modality's rate is the
share of its own tokens among them (no caps). With attention normalized globally, diluted visual
attention puts most visual tokens at the bottom of that ranking (UniCache article §2.3, §5.1).

Shape legend: B, T, H, D, 3 = batch, tokens, KV heads, head dim, modalities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from unicache_train.compress.config import BudgetConfig
from unicache_train.compress.grouped import grouped_rank
from unicache_train.compress.modality import modality_counts
from unicache_train.compress.state import CompressionState
from unicache_train.seam import NUM_MODALITIES

__all__ = ["ModalityBudget", "modality_density", "allocate_rates", "pooled_rates"]


@torch.no_grad()
def modality_density(
    keys: torch.Tensor,
    values: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    floor: float = 0.05,
) -> torch.Tensor:
    """Information density per modality (see module docstring).

    Args:
        keys, values: [B, H, T, D].
        modality_ids: [B, T]; context_mask: [B, T] bool.

    Returns:
        [B, 3] in ``[floor, 2]`` (1 for modalities with fewer than two tokens).
    """
    onehot = F.one_hot(modality_ids.clamp(0, NUM_MODALITIES - 1), NUM_MODALITIES).float()
    onehot = onehot * context_mask[..., None]  # [B, T, 3]
    n = onehot.sum(1)  # [B, 3]

    def mean_pair_cos(x: torch.Tensor) -> torch.Tensor:
        u = x.float() / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
        s = torch.einsum("bhtd,btm->bhmd", u, onehot)  # [B, H, 3, D] sum of unit vectors
        sq = (s * s).sum(-1).mean(1)  # [B, 3]
        return (sq - n) / (n * (n - 1)).clamp_min(1.0)

    sim = 0.5 * (mean_pair_cos(keys) + mean_pair_cos(values))
    rho = (1.0 - sim).clamp(floor, 2.0)
    return torch.where(n > 1, rho, torch.ones_like(rho))


def allocate_rates(
    layer_rate: torch.Tensor,
    counts: torch.Tensor,
    density: torch.Tensor,
    caps: Sequence[float],
    fixed: Sequence[float] | None = None,
    fixed_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-modality rates with token-weighted mean ``layer_rate`` (see module docstring).

    Args:
        layer_rate: [B] rate R of the layer.
        counts: [B, 3] context tokens per modality.
        density: [B, 3] rho.
        caps: 3 maximum rates.
        fixed: 3 fixed rates (NaN: decided by density), or None.
        fixed_scale: [B] factor applied to fixed rates (``R / target_rate``).

    Returns:
        [B, 3] rates (0 for absent modalities).
    """
    dev = layer_rate.device
    n = counts.float()
    cap = torch.tensor(list(caps), dtype=torch.float32, device=dev).expand_as(n)
    present = n > 0
    fix = (
        torch.full_like(n, float("nan"))
        if fixed is None
        else torch.tensor(list(fixed), dtype=torch.float32, device=dev).expand_as(n)
    )
    is_fixed = present & ~torch.isnan(fix)
    scale = torch.ones_like(layer_rate) if fixed_scale is None else fixed_scale
    r_fixed = torch.minimum(torch.nan_to_num(fix) * scale[:, None].float(), cap)
    free = present & ~is_fixed
    need = layer_rate.float() * n.sum(1) - (torch.where(is_fixed, r_fixed, 0.0) * n).sum(1)
    need = need.clamp_min(0.0)  # [B] tokens the free modalities must remove
    inv = 1.0 / density.float()
    capped = torch.zeros_like(free)
    for _ in range(NUM_MODALITIES):  # water-filling: each round caps at least one modality
        open_ = free & ~capped
        rest = need - (torch.where(capped, cap, 0.0) * n).sum(1)
        k = rest.clamp_min(0.0) / (torch.where(open_, inv, 0.0) * n).sum(1).clamp_min(1e-12)
        over = open_ & (k[:, None] * inv > cap)
        if not bool(over.any()):
            break
        capped |= over
    rates = torch.where(capped, cap, torch.minimum(k[:, None] * inv, cap))
    rates = torch.where(free, rates, torch.where(is_fixed, r_fixed, 0.0))
    return rates.clamp_min(0.0)


@torch.no_grad()
def pooled_rates(
    scores: torch.Tensor,
    modality_ids: torch.Tensor,
    context_mask: torch.Tensor,
    layer_rate: torch.Tensor,
) -> torch.Tensor:
    """Per-modality rates of one global ranking (``allocation="pooled"``).

    Args:
        scores: [B, T] importance (lower goes first; ties keep index order).
        modality_ids: [B, T]; context_mask: [B, T] bool.
        layer_rate: [B] rate R of the layer.

    Returns:
        [B, 3] ``dropped_m / n_m`` (0 for absent modalities), where the dropped tokens are the
        ``round(R * N)`` lowest-scored context tokens of the sample.
    """
    n = context_mask.sum(1)  # [B]
    k = torch.floor(layer_rate.float() * n.float() + 0.5).long()  # [B]
    rank = grouped_rank(scores.float(), torch.zeros_like(modality_ids), context_mask, 1)
    drop = context_mask & (rank < k[:, None])
    counts = modality_counts(modality_ids, context_mask).float()
    return modality_counts(modality_ids, drop).float() / counts.clamp_min(1.0)


@dataclass
class ModalityBudget(BudgetConfig):
    """Pipeline step: ``state.modality_rates`` (the layer rate for every modality if disabled).

    Fixed rates are scaled by ``layer_rate / state.reference_target`` (the configured target).
    """

    stage: ClassVar[int] = 4

    def __call__(self, state: CompressionState) -> CompressionState:
        R = state.layer_rate if state.layer_rate is not None else state.target.float()
        B = R.shape[0]
        counts = modality_counts(state.modality_ids, state.context_mask)
        if not self.enabled:
            state.modality_rates = R[:, None].expand(B, NUM_MODALITIES) * (counts > 0)
            return state
        if self.allocation == "pooled":
            # Without an importance step every score is 0: the ranking falls back to position.
            scores = state.scores if state.scores is not None else torch.zeros_like(R)[:, None]
            scores = scores.expand_as(state.context_mask)
            state.modality_rates = pooled_rates(scores, state.modality_ids, state.context_mask, R)
            return state
        rho = modality_density(
            state.keys, state.values, state.modality_ids, state.context_mask, self.density_floor
        )
        ref = state.reference_target
        scale = R / ref if ref > 0 else torch.zeros_like(R)
        state.modality_rates = allocate_rates(R, counts, rho, self.caps, self.fixed_rates, scale)
        return state
